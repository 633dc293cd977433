"""Dispatch and combine on PyTorch tensors, over :class:`nccl_ep.NCCLLibrary`.

PyTorch is not a dependency of ``nccl_ep``: this module imports it when it is imported itself
(``import nccl_ep.torch_ep``) and raises ``ImportError`` without it. Tensors reach the C API by
``data_ptr()`` in :class:`nccl_ep.ncclEpTensor_t` descriptors; operations run on the current
CUDA stream (or the one given) and their outputs are new tensors allocated by PyTorch on the
tensors' device. Example, one process per GPU::

    import torch, nccl_ep
    from nccl_ep.torch_ep import EpGroup
    lib = nccl_ep.NCCLLibrary()
    comm = ...  # an ncclComm_t of the NCCL lib loaded (lib.ncclCommInitRank(...))
    group = EpGroup(lib, comm, num_experts=256, max_tokens_per_rank=128, hidden=7168)
    with group.create_handle(topk_idx) as h:          # [B, K] int64, -1 = no expert
        d = h.dispatch(x)                              # x: [B, H] bfloat16
        y = experts(d.tokens, d.expert_counts)         # [L, R*M, H]
        out = h.combine(y, topk_weights)               # [B, H]

Low-latency steps can be captured in CUDA graphs (``torch.cuda.graph``) and replayed with the
inputs refilled in place: create the handle outside the capture, then ``copy_`` the new routing
into its ``topk_idx`` (and the new tokens and weights into theirs) before each replay; the
outputs of the captured step are rewritten by every replay. Keep the group's calls and replays
in one stream order::

    with group.create_handle(topk_idx) as h:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            d = h.dispatch(x)
            out = h.combine(experts(d.tokens, d.expert_counts), topk_weights)
        topk_idx.copy_(new_routing); x.copy_(new_tokens); topk_weights.copy_(new_weights)
        g.replay()                                     # out holds this step's result

Only what epflow's library implements is offered: low-latency expert-major and rank-major,
high-throughput flat (forward pass), BF16 tokens.
"""

import torch

from .constants import (
    NCCL_EP_ALGO_HIGH_THROUGHPUT,
    NCCL_EP_ALGO_LOW_LATENCY,
    NCCL_EP_AUTO,
    NCCL_EP_LAYOUT_EXPERT_MAJOR,
    NCCL_EP_LAYOUT_FLAT,
    NCCL_EP_LAYOUT_RANK_MAJOR,
    ncclDataType_t,
)
from .library import stream_handle
from .structs import (
    ncclEpCombineConfig_t,
    ncclEpCombineInputs_t,
    ncclEpCombineOutputs_t,
    ncclEpCompleteConfig_t,
    ncclEpDispatchConfig_t,
    ncclEpDispatchInputs_t,
    ncclEpDispatchOutputs_t,
    ncclEpGroupConfig_t,
    ncclEpLayoutInfo_t,
    ncclEpTensor_t,
)

#: torch dtype -> NCCL data type.
TORCH_TO_NCCL = {
    torch.int8: ncclDataType_t.ncclInt8,
    torch.uint8: ncclDataType_t.ncclUint8,
    torch.int32: ncclDataType_t.ncclInt32,
    torch.int64: ncclDataType_t.ncclInt64,
    torch.float16: ncclDataType_t.ncclFloat16,
    torch.float32: ncclDataType_t.ncclFloat32,
    torch.float64: ncclDataType_t.ncclFloat64,
    torch.bfloat16: ncclDataType_t.ncclBfloat16,
}
if hasattr(torch, "float8_e4m3fn"):
    TORCH_TO_NCCL[torch.float8_e4m3fn] = ncclDataType_t.ncclFloat8e4m3
if hasattr(torch, "float8_e5m2"):
    TORCH_TO_NCCL[torch.float8_e5m2] = ncclDataType_t.ncclFloat8e5m2


def tensor_desc(t):
    """An :class:`ncclEpTensor_t` describing the torch tensor ``t`` (contiguous, on a CUDA
    device; its ``data_ptr()``, dtype and shape). The descriptor does not keep ``t`` alive:
    the caller does, until the operation using it is complete."""
    if not isinstance(t, torch.Tensor):
        raise TypeError("expected a torch.Tensor, got %r" % type(t).__name__)
    if t.dtype not in TORCH_TO_NCCL:
        raise TypeError("torch dtype %s has no NCCL data type" % t.dtype)
    if not t.is_contiguous():
        raise ValueError("NCCL EP tensors are dense: call .contiguous() first (shape %s, strides %s)" % (tuple(t.shape), t.stride()))
    if t.device.type != "cuda":
        raise ValueError("NCCL EP tensors live on the GPU, this one is on %s" % t.device)
    return ncclEpTensor_t(t.data_ptr(), TORCH_TO_NCCL[t.dtype], tuple(t.shape))


def _stream(stream, device):
    s = stream if stream is not None else torch.cuda.current_stream(device)
    return stream_handle(s)


class DispatchResult:
    """What :meth:`EpHandle.dispatch` returns: the received ``tokens`` and, by layout,
    ``expert_counts`` (low-latency expert-major, ``[L]`` int32: rows received per local expert),
    ``rank_counts`` (low-latency rank-major, ``[R]`` int32: tokens received per source rank),
    ``topk_weights`` and ``topk_idx`` (rank-major ``[R, M, K]``, int32 local expert ids; flat
    ``[N, K]``, int64), or ``None``."""

    def __init__(self, tokens, expert_counts=None, rank_counts=None, topk_weights=None, topk_idx=None):
        self.tokens = tokens
        self.expert_counts = expert_counts
        self.rank_counts = rank_counts
        self.topk_weights = topk_weights
        self.topk_idx = topk_idx


class EpGroup:
    """An ``ncclEpGroup_t`` of shape (``num_experts``, ``max_tokens_per_rank``, ``hidden``) over
    ``comm``; BF16 tokens of ``hidden`` elements. ``num_ranks`` and ``rank`` are read from the
    communicator when the library has NCCL's functions, else they must be given."""

    def __init__(
        self,
        lib,
        comm,
        num_experts,
        max_tokens_per_rank,
        hidden,
        algorithm=NCCL_EP_ALGO_LOW_LATENCY,
        max_recv_tokens_per_rank=NCCL_EP_AUTO,
        num_ranks=None,
        rank=None,
        device=None,
        **config_fields
    ):
        """Creates the group (collective over ``comm``). ``config_fields`` set further
        :class:`ncclEpGroupConfig_t` fields (``timeout_ns``, ``max_num_sms``, ``enable_mask``)."""
        self.lib = lib
        if num_ranks is None:
            num_ranks = lib.ncclCommCount(comm)
        if rank is None:
            rank = lib.ncclCommUserRank(comm)
        if device is None:
            device = torch.device("cuda", lib.ncclCommCuDevice(comm)) if lib.have_nccl else torch.device("cuda", torch.cuda.current_device())
        self.device = torch.device(device)
        self.num_ranks, self.rank = int(num_ranks), int(rank)
        self.num_experts, self.max_tokens, self.hidden = int(num_experts), int(max_tokens_per_rank), int(hidden)
        if self.num_experts % self.num_ranks:
            raise ValueError("num_experts (%d) must be a multiple of the ranks (%d)" % (num_experts, num_ranks))
        self.local_experts = self.num_experts // self.num_ranks
        self.algorithm = int(algorithm)
        if self.algorithm == NCCL_EP_ALGO_HIGH_THROUGHPUT and max_recv_tokens_per_rank == NCCL_EP_AUTO:
            max_recv_tokens_per_rank = self.num_ranks * self.max_tokens
        self.config = ncclEpGroupConfig_t(
            algorithm=self.algorithm,
            num_experts=self.num_experts,
            max_dispatch_tokens_per_rank=self.max_tokens,
            max_recv_tokens_per_rank=int(max_recv_tokens_per_rank),
            max_token_bytes=2 * self.hidden,
            **config_fields
        )
        self.handle = lib.ncclEpCreateGroup(comm, self.config)

    def create_handle(self, topk_idx, layout=None, stream=None):
        """An :class:`EpHandle` for the routing ``topk_idx`` (``[B, K]`` int64 on this group's
        device, -1 = no expert). ``layout`` defaults to expert-major (low-latency) or flat
        (high-throughput)."""
        if layout is None:
            layout = NCCL_EP_LAYOUT_EXPERT_MAJOR if self.algorithm == NCCL_EP_ALGO_LOW_LATENCY else NCCL_EP_LAYOUT_FLAT
        return EpHandle(self, topk_idx, int(layout), stream)

    def destroy(self):
        """``ncclEpGroupDestroy`` (collective); destroy the handles first."""
        if self.handle is not None:
            h, self.handle = self.handle, None
            self.lib.ncclEpGroupDestroy(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


class EpHandle:
    """An ``ncclEpHandle_t``: one routing of a group and its dispatch/combine pair. Keeps
    ``topk_idx`` alive (low-latency handles read it in the dispatches' stream order)."""

    def __init__(self, group, topk_idx, layout, stream=None):
        """Creates the handle (``ncclEpCreateHandle``; collective for high-throughput, where it
        also learns how many tokens this rank receives)."""
        if topk_idx.dtype != torch.int64 or topk_idx.dim() != 2:
            raise ValueError("topk_idx must be [num_tokens, top_k] int64, got %s %s" % (tuple(topk_idx.shape), topk_idx.dtype))
        self.group, self.layout = group, layout
        self.topk_idx = topk_idx.contiguous()
        self.num_tokens, self.top_k = self.topk_idx.shape
        self.num_recv = None
        self._staged = None
        g = group
        info = None
        if g.algorithm == NCCL_EP_ALGO_HIGH_THROUGHPUT:
            self._recv_total = torch.zeros(1, dtype=torch.int32, device=g.device)
            info = ncclEpLayoutInfo_t(recv_total_counter=tensor_desc(self._recv_total))
        self.handle = g.lib.ncclEpCreateHandle(
            g.handle, layout, tensor_desc(self.topk_idx), info, None, _stream(stream, g.device)
        )
        if info is not None:
            # The library wrote the count before returning (it synchronizes the stream first).
            self.num_recv = int(self._recv_total.item())

    def dispatch(self, tokens, topk_weights=None, send_only=False, stream=None):
        """``ncclEpDispatch`` of ``tokens`` (``[B, H]`` bfloat16). Rank-major and flat need
        ``topk_weights`` (``[B, K]`` float32). With ``send_only``, call :meth:`complete` before
        reading the result. Returns a :class:`DispatchResult` of new tensors."""
        g = self.group
        L, R, M, H, K = g.local_experts, g.num_ranks, g.max_tokens, g.hidden, self.top_k
        dev = g.device
        keep = [tokens, topk_weights]
        inputs = ncclEpDispatchInputs_t(tokens=tensor_desc(tokens))
        if topk_weights is not None:
            inputs.topk_weights = tensor_desc(topk_weights)
        info = None
        if g.algorithm == NCCL_EP_ALGO_LOW_LATENCY and self.layout == NCCL_EP_LAYOUT_EXPERT_MAJOR:
            res = DispatchResult(
                torch.empty((L, R * M, H), dtype=torch.bfloat16, device=dev),
                expert_counts=torch.zeros(L, dtype=torch.int32, device=dev),
            )
            outputs = ncclEpDispatchOutputs_t(tokens=tensor_desc(res.tokens))
            info = ncclEpLayoutInfo_t(expert_counters=tensor_desc(res.expert_counts))
        elif g.algorithm == NCCL_EP_ALGO_LOW_LATENCY and self.layout == NCCL_EP_LAYOUT_RANK_MAJOR:
            res = DispatchResult(
                torch.empty((R, M, H), dtype=torch.bfloat16, device=dev),
                rank_counts=torch.zeros(R, dtype=torch.int32, device=dev),
                topk_weights=torch.empty((R, M, K), dtype=torch.float32, device=dev),
                topk_idx=torch.empty((R, M, K), dtype=torch.int32, device=dev),
            )
            outputs = ncclEpDispatchOutputs_t(
                tokens=tensor_desc(res.tokens), topk_weights=tensor_desc(res.topk_weights), topk_idx=tensor_desc(res.topk_idx)
            )
            info = ncclEpLayoutInfo_t(src_rank_counters=tensor_desc(res.rank_counts))
        elif g.algorithm == NCCL_EP_ALGO_HIGH_THROUGHPUT and self.layout == NCCL_EP_LAYOUT_FLAT:
            n = self.num_recv
            res = DispatchResult(
                torch.empty((n, H), dtype=torch.bfloat16, device=dev),
                topk_weights=torch.empty((n, K), dtype=torch.float32, device=dev),
                topk_idx=torch.empty((n, K), dtype=torch.int64, device=dev),
            )
            outputs = ncclEpDispatchOutputs_t(
                tokens=tensor_desc(res.tokens), topk_weights=tensor_desc(res.topk_weights), topk_idx=tensor_desc(res.topk_idx)
            )
        else:
            raise ValueError("layout %d is not offered for algorithm %d" % (self.layout, g.algorithm))
        config = ncclEpDispatchConfig_t(send_only=int(bool(send_only)))
        g.lib.ncclEpDispatch(self.handle, inputs, outputs, info, config, _stream(stream, dev))
        self._staged = (res, keep) if send_only else None
        return res

    def combine(self, expert_out, topk_weights=None, send_only=False, stream=None):
        """``ncclEpCombine``: ``expert_out`` has the shape of the dispatch's ``tokens`` (one row
        per received slot, bfloat16); low-latency expert-major applies ``topk_weights``
        (``[B, K]`` float32) on the way back; rank-major and flat expect rows already weighted
        and reduced. Returns the new ``[B, H]`` bfloat16 tensor in the original token order."""
        g = self.group
        out = torch.empty((self.num_tokens, g.hidden), dtype=torch.bfloat16, device=g.device)
        inputs = ncclEpCombineInputs_t(tokens=tensor_desc(expert_out))
        outputs = ncclEpCombineOutputs_t(tokens=tensor_desc(out))
        if topk_weights is not None:
            outputs.topk_weights = tensor_desc(topk_weights)
        config = ncclEpCombineConfig_t(send_only=int(bool(send_only)))
        g.lib.ncclEpCombine(self.handle, inputs, outputs, config, _stream(stream, g.device))
        self._staged = (out, [expert_out, topk_weights]) if send_only else None
        return out

    def complete(self, stream=None):
        """``ncclEpComplete``: the receive half of a ``send_only`` dispatch or combine."""
        g = self.group
        g.lib.ncclEpComplete(self.handle, ncclEpCompleteConfig_t(), _stream(stream, g.device))
        self._staged = None

    def destroy(self):
        """``ncclEpHandleDestroy``."""
        if self.handle is not None:
            h, self.handle = self.handle, None
            self.group.lib.ncclEpHandleDestroy(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.destroy()


__all__ = ["tensor_desc", "EpGroup", "EpHandle", "DispatchResult", "TORCH_TO_NCCL"]

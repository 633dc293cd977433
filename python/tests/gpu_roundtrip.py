#!/usr/bin/env python3
"""Dispatch/combine round trips through the ``nccl_ep`` Python package on one GPU, one rank.

    EPFLOW_LIB=target/release/libnccl_ep.so python3 python/tests/gpu_roundtrip.py

Makes a one-rank NCCL communicator (``ncclGetUniqueId`` + ``ncclCommInitRank`` of the
``libnccl.so.2`` that ``nccl_ep`` loaded with ``RTLD_GLOBAL``), moves memory with the CUDA driver
API (``libcuda.so.1``, through ctypes) and checks, against a CPU reference computed here in pure
Python from fresh random inputs (the seed is printed; ``--seed`` replays one):

- low-latency, expert-major: per-expert counts, the received rows, the weighted combine; once
  directly, once staged (``send_only`` + ``ncclEpComplete``), once with an int32 ``topk_idx``
  (API v2), and with API v2's ``DS_FP8E3M4`` recipe directly and staged (e4m3 rows: every scale
  exact, every value within e4m3's rounding; the combine of the dequantized rows), once with the
  scales 4 bytes into their allocation (fp32 alignment, as NVIDIA's own test places them);
- low-latency, expert-major again on a group whose config gives ``alloc_fn`` / ``free_fn``
  (``cuMemAlloc`` / ``cuMemFree``, counted): the same results, ``alloc_fn`` called for the
  group's scratch and the handle's memory with the config's context, and every allocation given
  back through ``free_fn`` once the handle and the group are destroyed;
- low-latency, rank-major: received rows, top-k weights and local expert ids, source-rank count,
  the combine of caller-reduced rows;
- high-throughput, flat: the receive count from ``recv_total_counter``, rows, weights and ids
  (and the unused rows marked -1/0), the combine;
- high-throughput expert-major: the padded counts, zone offsets and slot total of the handle,
  every zone's tokens (in token order) and weights, zero padding, the combine of every slot;
  then the backward pass on the handle (gradients into the same slots, and the backward combine
  of slots with a weight gradient each);
- low-latency rank-major and high-throughput flat again with API v2's GLOBAL expert ids (on one
  rank the same values as local ones: the call path is checked here, the offsets by the Rust
  GPU test ``global_expert_ids_gain_the_rank_offset_on_live_rows_only``);
- low-latency expert-major with API v2's ``FWD`` recipe (rows the caller quantized, forwarded
  as bytes): e4m3 rows with fp32 scales, and packed FP4 (``ncclFloat4x2``) with ``ncclUint8``
  scales, directly and staged: every expert's rows and scale rows are its tokens' bytes exactly;
- the ``FWD`` recipe in high-throughput groups: flat (e4m3 + fp32 scales: every routed token's
  bytes once, with its ids) and expert-major (fp4x2 + uint8, zones aligned to 4: each zone's
  rows are its tokens' bytes in token order with their weights, the padding zero);
- with PyTorch importable, the expert-major round trip again through ``nccl_ep.torch_ep``.

Without a GPU (no ``libcuda.so.1`` or no device) it prints ``SKIPPED`` and exits 0 (exit 2
with ``--require-gpu``). Any mismatch exits 1.
"""

import argparse
import array
import ctypes
import os
import random
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the source tree's nccl_ep when not installed

import nccl_ep  # noqa: E402
from nccl_ep import (  # noqa: E402
    NCCL_EP_ALGO_HIGH_THROUGHPUT,
    NCCL_EP_ALGO_LOW_LATENCY,
    NCCL_EP_LAYOUT_EXPERT_MAJOR,
    NCCL_EP_LAYOUT_FLAT,
    NCCL_EP_LAYOUT_RANK_MAJOR,
    ncclBfloat16,
    ncclFloat8e4m3,
    ncclFloat32,
    ncclInt32,
    ncclInt64,
)

# ---------------------------------------------------------------------------------------------
# BF16 on the host


def bf16_bits(x):
    """float -> BF16 bits, round to nearest even."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    return ((b + 0x7FFF + ((b >> 16) & 1)) >> 16) & 0xFFFF


def bf16_val(bits):
    """BF16 bits -> float."""
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def bf16(x):
    """x rounded to BF16, as a float."""
    return bf16_val(bf16_bits(x))


def f32(x):
    """x rounded to float32, as a float."""
    return struct.unpack("<f", struct.pack("<f", x))[0]


def e4m3_val(b):
    """FP8 e4m3 ("E4M3FN") bits -> float (NaN for 0x7f / 0xff)."""
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    if e == 15 and m == 7:
        return float("nan")
    if e == 0:
        return sign * m * 2.0 ** -9
    return sign * (1 + m / 8.0) * 2.0 ** (e - 7)


def ds_fp8_scale(block_bits):
    """The scale of one 128-channel block under DS_FP8E3M4 (epflow's FP8): fp32 amax / 448,
    amax floored at 1e-4."""
    amax = max([abs(bf16_val(b)) for b in block_bits] + [f32(1e-4)])
    return f32(amax / 448.0)


# NVFP4 on the host (epflow_core::nvfp4, every step an fp32 operation)

E4M3_CODES = [(c, e4m3_val(c)) for c in range(0x7F)]
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def e4m3_rn(x):
    """A non-negative fp32 -> the nearest e4m3 value (ties to the even code), saturating at 448."""
    return min(E4M3_CODES, key=lambda cv: (abs(cv[1] - x), cv[0] & 1))[1]


def e2m1_rn(y):
    """fp32 -> the nearest E2M1 value (ties to the even code), saturating at 6, the sign kept."""
    a = abs(y)
    m = 0 if a <= 0.25 else 1 if a < 0.75 else 2 if a <= 1.25 else 3 if a < 1.75 else 4 if a <= 2.5 else 5 if a < 3.5 else 6 if a <= 5.0 else 7
    return -E2M1[m] if y < 0 else E2M1[m]


def nvfp4_global_scale(row_bits):
    amax = max(abs(bf16_val(b)) for b in row_bits)
    return 0.0 if amax == 0 else f32(2688.0 / amax)


def nvfp4_round_trip(row_bits, g):
    """What an NVFP4 combine's receiver sums for a row of BF16 bits under global scale ``g``."""
    out = []
    for c0 in range(0, len(row_bits), 16):
        x = [bf16_val(b) for b in row_bits[c0:c0 + 16]]
        amax = max(abs(v) for v in x)
        s = e4m3_rn(f32(f32(amax / 6.0) * g))
        enc = 0.0 if s == 0 else f32(g / s)
        dec = 0.0 if s == 0 or g == 0 else f32(s / g)
        out.extend(f32(e2m1_rn(f32(v * enc)) * dec) for v in x)
    return out


# ---------------------------------------------------------------------------------------------
# The CUDA driver API through ctypes


class Cuda:
    """The few driver calls this test needs; device memory is freed at exit."""

    def __init__(self, device):
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.check("cuInit", self.lib.cuInit(0))
        dev = ctypes.c_int()
        self.check("cuDeviceGet", self.lib.cuDeviceGet(ctypes.byref(dev), device))
        self.ctx = ctypes.c_void_p()
        self.check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self.ctx), dev))
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self.ctx))
        self.lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t]
        self.lib.cuMemcpyHtoD_v2.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t]
        self.lib.cuMemcpyDtoH_v2.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t]
        self.lib.cuMemsetD8_v2.argtypes = [ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t]
        self.lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        self.lib.cuStreamSynchronize.argtypes = [ctypes.c_void_p]
        self.lib.cuStreamDestroy_v2.argtypes = [ctypes.c_void_p]
        self.allocs = []

    @staticmethod
    def check(what, rc):
        if rc != 0:
            raise RuntimeError("CUDA driver: %s returned %d" % (what, rc))

    def alloc(self, nbytes, fill=0):
        p = ctypes.c_uint64()
        self.check("cuMemAlloc", self.lib.cuMemAlloc_v2(ctypes.byref(p), max(nbytes, 1)))
        self.allocs.append(p.value)
        self.check("cuMemsetD8", self.lib.cuMemsetD8_v2(p.value, fill, max(nbytes, 1)))
        return p.value

    def upload(self, arr):
        """A new device buffer holding ``arr`` (an ``array.array``)."""
        nbytes = len(arr) * arr.itemsize
        p = self.alloc(nbytes)
        if nbytes:
            addr, _ = arr.buffer_info()
            self.check("cuMemcpyHtoD", self.lib.cuMemcpyHtoD_v2(p, addr, nbytes))
        return p

    def write(self, ptr, arr):
        """Copies ``arr`` (an ``array.array``) into the device buffer at ``ptr``."""
        nbytes = len(arr) * arr.itemsize
        if nbytes:
            addr, _ = arr.buffer_info()
            self.check("cuMemcpyHtoD", self.lib.cuMemcpyHtoD_v2(ptr, addr, nbytes))

    def capture(self, stream, enqueue):
        """A CUDA graph of what ``enqueue()`` puts on ``stream`` (captured in the global mode,
        the strictest), instantiated; returns ``(graph, exec)``. An abandoned capture is ended."""
        self.check("cuStreamBeginCapture", self.lib.cuStreamBeginCapture_v2(ctypes.c_void_p(stream), 0))
        graph = ctypes.c_void_p()
        try:
            enqueue()
        finally:
            rc = self.lib.cuStreamEndCapture(ctypes.c_void_p(stream), ctypes.byref(graph))
        self.check("cuStreamEndCapture", rc)
        exe = ctypes.c_void_p()
        self.check("cuGraphInstantiateWithFlags", self.lib.cuGraphInstantiateWithFlags(ctypes.byref(exe), graph, ctypes.c_ulonglong(0)))
        return graph, exe

    def launch_graph(self, exe, stream):
        self.check("cuGraphLaunch", self.lib.cuGraphLaunch(exe, ctypes.c_void_p(stream)))

    def destroy_graph(self, graph, exe):
        self.lib.cuGraphExecDestroy(exe)
        self.lib.cuGraphDestroy(graph)

    def download(self, ptr, typecode, count):
        arr = array.array(typecode, bytes(count * array.array(typecode).itemsize))
        if count:
            addr, _ = arr.buffer_info()
            self.check("cuMemcpyDtoH", self.lib.cuMemcpyDtoH_v2(addr, ptr, len(arr) * arr.itemsize))
        return arr

    def stream(self):
        s = ctypes.c_void_p()
        self.check("cuStreamCreate", self.lib.cuStreamCreate(ctypes.byref(s), 0))
        return s.value

    def sync(self, stream):
        self.check("cuStreamSynchronize", self.lib.cuStreamSynchronize(stream))

    def free_all(self):
        for p in self.allocs:
            self.lib.cuMemFree_v2(p)
        self.allocs = []


class CountingAllocator:
    """A group config's ``alloc_fn`` / ``free_fn`` over ``cuMemAlloc`` / ``cuMemFree`` that
    count the calls and bytes, check the context they are given, and keep every live allocation
    (a free of an address it did not hand out, or handed out twice, is recorded and refused).
    The driver's codes are returned as ``cudaError_t``: 0 is success in both."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.marker = ctypes.c_int(66)  # its address is the config's context
        self.context = ctypes.addressof(self.marker)
        self.live = {}
        self.allocs = self.frees = 0
        self.bytes_allocated = self.bytes_freed = 0
        self.problems = []
        # Kept here: ctypes callbacks must outlive the group (and its handles).
        self.alloc_fn = nccl_ep.ncclEpAllocFn_t(self._alloc)
        self.free_fn = nccl_ep.ncclEpFreeFn_t(self._free)

    def install(self, cfg):
        """Sets ``cfg.alloc`` to this allocator."""
        cfg.alloc.alloc_fn = self.alloc_fn
        cfg.alloc.free_fn = self.free_fn
        cfg.alloc.context = self.context

    def _alloc(self, ptr, size, context):
        try:
            if context != self.context:
                self.problems.append("alloc_fn got context %r, expected %#x" % (context, self.context))
            p = ctypes.c_uint64()
            rc = self.cuda.lib.cuMemAlloc_v2(ctypes.byref(p), size)
            if rc != 0:
                self.problems.append("cuMemAlloc of %d B returned %d" % (size, rc))
                return rc
            ptr[0] = p.value
            self.live[p.value] = size
            self.allocs += 1
            self.bytes_allocated += size
            return 0
        except Exception as e:  # an exception must not cross into C (ctypes would return 0)
            self.problems.append("alloc_fn raised %r" % (e,))
            return 2  # cudaErrorMemoryAllocation

    def _free(self, ptr, context):
        try:
            if context != self.context:
                self.problems.append("free_fn got context %r, expected %#x" % (context, self.context))
            size = self.live.pop(ptr or 0, None)
            if size is None:
                self.problems.append("free_fn got %r, which alloc_fn did not hand out (or was freed already)" % (ptr,))
                return 1  # cudaErrorInvalidValue
            self.frees += 1
            self.bytes_freed += size
            return self.cuda.lib.cuMemFree_v2(ptr)
        except Exception as e:
            self.problems.append("free_fn raised %r" % (e,))
            return 1

    def wait_all_freed(self, seconds=2.0):
        """Whether every allocation was freed, waiting up to ``seconds`` (a handle's memory may
        be given back by one of the library's threads)."""
        deadline = time.time() + seconds
        while self.live and time.time() < deadline:
            time.sleep(0.01)
        return not self.live


def gpu_count():
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    if cuda.cuInit(0) != 0:
        return 0
    n = ctypes.c_int(0)
    return n.value if cuda.cuDeviceGetCount(ctypes.byref(n)) == 0 else 0


# ---------------------------------------------------------------------------------------------
# The problem and its CPU reference


class Problem:
    """B tokens of H BF16 values, top-K routing over E experts (distinct per token, some -1),
    float32 weights, and the "expert": expert e multiplies by (e + 1) / 8."""

    def __init__(self, rng, num_experts, max_tokens, hidden, top_k, tokens=None):
        self.E, self.M, self.H, self.K = num_experts, max_tokens, hidden, top_k
        self.B = tokens if tokens is not None else rng.randint(max_tokens // 2, max_tokens)
        self.x = [[bf16_bits(rng.uniform(-2.0, 2.0)) for _ in range(hidden)] for _ in range(self.B)]
        self.idx = []
        for t in range(self.B):
            experts = rng.sample(range(num_experts), top_k)
            row = [e if rng.random() > 0.15 else -1 for e in experts]
            if t == 0:
                row = [-1] * top_k  # one token that goes nowhere
            self.idx.append(row)
        self.w = [[struct.unpack("<f", struct.pack("<f", rng.uniform(0.05, 1.0)))[0] for _ in range(top_k)] for _ in range(self.B)]

    @staticmethod
    def scale(e):
        return (e + 1) / 8.0

    def expert(self, e, row_bits):
        """The expert's output row (BF16 bits) for an input row."""
        s = self.scale(e)
        return [bf16_bits(bf16_val(b) * s) for b in row_bits]

    def routed(self, t):
        return [e for e in self.idx[t] if e >= 0]

    def tokens_of(self, e):
        return [t for t in range(self.B) if e in self.idx[t]]

    def weighted(self, t, row=None):
        """sum_k w[t,k] * expert(idx[t,k], x[t]) in fp32 (as floats): what combine returns
        (``row``: the BF16 bits the experts saw instead of ``x[t]``)."""
        acc = [0.0] * self.H
        for k, e in enumerate(self.idx[t]):
            if e < 0:
                continue
            y = self.expert(e, self.x[t] if row is None else row)
            for h in range(self.H):
                acc[h] += self.w[t][k] * bf16_val(y[h])
        return acc

    def flat(self, typecode, rows):
        out = array.array(typecode)
        for r in rows:
            out.extend(r)
        return out


class Checker:
    def __init__(self):
        self.failures = 0
        self.checks = 0

    def expect(self, ok, what):
        self.checks += 1
        if not ok:
            self.failures += 1
            print("  FAIL: %s" % what)
        return ok

    def close(self, got_bits, want, what, rtol=1e-2, atol=1e-2):
        bad = 0
        first = None
        for h, (g, w) in enumerate(zip(got_bits, want)):
            gv = bf16_val(g)
            if abs(gv - w) > atol + rtol * abs(w):
                bad += 1
                if first is None:
                    first = (h, gv, w)
        return self.expect(bad == 0, "%s: %d values off (first: [%s] got %r want %r)" % ((what, bad) + (first or (0, 0, 0))))


def desc(ptr, dtype, shape):
    return nccl_ep.ncclEpTensor_t(ptr, dtype, shape)


def rows(arr, n, width):
    return [list(arr[i * width:(i + 1) * width]) for i in range(n)]


# ---------------------------------------------------------------------------------------------
# The round trips


def check_fp8_rows(p, chk, e, counts, recv, scales, combine_in, deq_of):
    """Expert ``e``'s FP8 rows (DS_FP8E3M4, one rank: its tokens in token order): each scale is
    amax / 448 of its block exactly, and each dequantized value within e4m3's rounding of the
    token's (half an ulp: 1/16 of the value, or half the subnormal step). Writes the expert's
    output of the dequantized row (rounded to BF16) into ``combine_in`` and records each
    token's dequantized row in ``deq_of``."""
    H, M = p.H, p.M
    cols = H // 128
    toks = p.tokens_of(e)
    chk.expect(counts[e] == len(toks), "FP8: expert %d received %d rows, expected %d" % (e, counts[e], len(toks)))
    for j, t in enumerate(toks[: min(counts[e], M)]):
        row = recv[(e * M + j) * H:(e * M + j + 1) * H]
        sc = scales[(e * M + j) * cols:(e * M + j + 1) * cols]
        want_sc = [ds_fp8_scale(p.x[t][c * 128:(c + 1) * 128]) for c in range(cols)]
        chk.expect(list(sc) == want_sc, "FP8: expert %d row %d (token %d): scales %r, expected %r" % (e, j, t, list(sc)[:2], want_sc[:2]))
        deq = [e4m3_val(row[h]) * sc[h // 128] for h in range(H)]
        bad = [h for h in range(H) if not abs(deq[h] - bf16_val(p.x[t][h])) <= abs(bf16_val(p.x[t][h])) / 16 + sc[h // 128] * 2.0 ** -9]
        chk.expect(not bad, "FP8: expert %d row %d (token %d): %d values off, first at %r" % (e, j, t, len(bad), bad[:1]))
        deq_bits = [bf16_bits(v) for v in deq]
        deq_of[t] = deq_bits
        base = (e * M + j) * H
        combine_in[base:base + H] = array.array("H", p.expert(e, deq_bits))


def low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged, idx32=False, fp8=False, allocator=None, nvfp4=False,
                             scales_offset=0):
    """``allocator``: a :class:`CountingAllocator` the group's config gives as ``alloc_fn`` /
    ``free_fn``; checked to serve the group's scratch and the handle's memory. ``scales_offset``:
    FP8's ``outputs.scales`` start that many bytes into their allocation (NVIDIA's own test puts
    them 4 bytes in: fp32 alignment is all DS_FP8E3M4 asks). ``nvfp4``: the
    combine travels as NVFP4 (API v2's ``NCCL_EP_COMB_QUANT_NVFP4``, ``inputs.scales`` each
    row's ``2688 / amax``), checked against the same quantization on the host."""
    E, M, H, K = p.E, p.M, p.H, p.K
    L, R = E, 1
    cfg = nccl_ep.ncclEpGroupConfig_t(
        algorithm=NCCL_EP_ALGO_LOW_LATENCY, num_experts=E, max_dispatch_tokens_per_rank=M, max_token_bytes=2 * H
    )
    if allocator is not None:
        allocator.install(cfg)
    group = lib.ncclEpCreateGroup(comm, cfg)
    group_allocs = allocator.allocs if allocator is not None else 0
    if allocator is not None:
        chk.expect(group_allocs > 0, "alloc_fn: not called for the group's local scratch")
    try:
        x_d = cuda.upload(p.flat("H", p.x))
        # API v2 lets low-latency callers pass an int32 topk_idx (epflow widens it on the stream).
        idx_d = cuda.upload(p.flat("i" if idx32 else "q", p.idx))
        w_d = cuda.upload(p.flat("f", p.w))
        topk = desc(idx_d, ncclInt32 if idx32 else ncclInt64, (p.B, K))
        handle = lib.ncclEpCreateHandle(group, NCCL_EP_LAYOUT_EXPERT_MAJOR, topk, None, None, stream)
        if allocator is not None:
            chk.expect(allocator.allocs > group_allocs, "alloc_fn: not called for the handle's memory (%d calls)" % allocator.allocs)
        try:
            recv_d = cuda.alloc(L * R * M * H * (1 if fp8 else 2), fill=0xA5)
            scales_d = cuda.alloc(L * R * M * (H // 128) * 4 + scales_offset, fill=0xA5) + scales_offset if fp8 else None
            counts_d = cuda.alloc(L * 4)
            din = nccl_ep.ncclEpDispatchInputs_t(tokens=desc(x_d, ncclBfloat16, (p.B, H)))
            if fp8:
                # API v2's DS_FP8E3M4: BF16 in, e4m3 rows and one fp32 scale per 128 channels out.
                dout = nccl_ep.ncclEpDispatchOutputs_t(
                    tokens=desc(recv_d, ncclFloat8e4m3, (L, R * M, H)),
                    scales=desc(scales_d, ncclFloat32, (L, R * M, H // 128)),
                )
                dcfg = nccl_ep.ncclEpDispatchConfig_v2_t(
                    send_only=int(staged), quant_recipe=nccl_ep.NCCL_EP_DISP_QUANT_DS_FP8E3M4
                )
            else:
                dout = nccl_ep.ncclEpDispatchOutputs_t(tokens=desc(recv_d, ncclBfloat16, (L, R * M, H)))
                dcfg = nccl_ep.ncclEpDispatchConfig_t(send_only=int(staged))
            info = nccl_ep.ncclEpLayoutInfo_t(expert_counters=desc(counts_d, ncclInt32, (L,)))
            lib.ncclEpDispatch(handle, din, dout, info, dcfg, stream)
            if staged:
                lib.ncclEpComplete(handle, nccl_ep.ncclEpCompleteConfig_t(), stream)
            cuda.sync(stream)
            counts = cuda.download(counts_d, "i", L)
            combine_in = array.array("H", bytes(L * R * M * H * 2))
            deq_of = {}
            if fp8:
                recv = cuda.download(recv_d, "B", L * R * M * H)
                scales = cuda.download(scales_d, "f", L * R * M * (H // 128))
                for e in range(L):
                    check_fp8_rows(p, chk, e, counts, recv, scales, combine_in, deq_of)
            else:
                recv = cuda.download(recv_d, "H", L * R * M * H)
                for e in range(L):
                    want = sorted(tuple(p.x[t]) for t in p.tokens_of(e))
                    chk.expect(counts[e] == len(want), "expert %d received %d rows, expected %d" % (e, counts[e], len(want)))
                    base = e * R * M * H
                    got_rows = [tuple(recv[base + j * H: base + (j + 1) * H]) for j in range(min(counts[e], R * M))]
                    chk.expect(sorted(got_rows) == want, "expert %d: the received rows are not its tokens" % e)
                    for j, r in enumerate(got_rows):
                        combine_in[base + j * H: base + (j + 1) * H] = array.array("H", p.expert(e, r))
            y_in_d = cuda.upload(combine_in)
            out_d = cuda.alloc(p.B * H * 2)
            if nvfp4:
                rows_in = [combine_in[r * H:(r + 1) * H] for r in range(L * R * M)]
                g = array.array("f", [nvfp4_global_scale(r) for r in rows_in])
                # Each token's rows as the receiver sums them, by (expert, input row bits).
                seen = {(r // (R * M), tuple(rows_in[r])): nvfp4_round_trip(rows_in[r], g[r]) for r in range(L * R * M) if any(rows_in[r])}
                g_d = cuda.upload(g)
                cin = nccl_ep.ncclEpCombineInputs_v2_t(
                    tokens=desc(y_in_d, ncclBfloat16, (L, R * M, H)), scales=desc(g_d, ncclFloat32, (L, R * M, 1))
                )
                ccfg = nccl_ep.ncclEpCombineConfig_v2_t(send_only=int(staged), quant_recipe=nccl_ep.NCCL_EP_COMB_QUANT_NVFP4)
            else:
                cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(y_in_d, ncclBfloat16, (L, R * M, H)))
                ccfg = nccl_ep.ncclEpCombineConfig_t(send_only=int(staged))
            cout = nccl_ep.ncclEpCombineOutputs_t(
                tokens=desc(out_d, ncclBfloat16, (p.B, H)), topk_weights=desc(w_d, ncclFloat32, (p.B, K))
            )
            lib.ncclEpCombine(handle, cin, cout, ccfg, stream)
            if staged:
                lib.ncclEpComplete(handle, None, stream)
            cuda.sync(stream)
            out = cuda.download(out_d, "H", p.B * H)
            changed = 0
            for t in range(p.B):
                # FP8: the experts saw the dequantized rows, so the reference combines those.
                want = p.weighted(t, deq_of.get(t)) if fp8 else p.weighted(t)
                if nvfp4:
                    exact = want
                    want = [0.0] * H
                    for k, e in enumerate(p.idx[t]):
                        if e >= 0:
                            y = seen[(e, tuple(p.expert(e, p.x[t])))]
                            want = [f32(a + p.w[t][k] * v) for a, v in zip(want, y)]
                    changed += sum(1 for a, b in zip(want, exact) if abs(a - b) > 1e-2 + 1e-2 * abs(b))
                chk.close(out[t * H:(t + 1) * H], want, "LL expert-major combine, token %d" % t)
            if nvfp4:
                chk.expect(changed > 0, "NVFP4: no value differs from the BF16 combine's (was it quantized?)")
        finally:
            lib.ncclEpHandleDestroy(handle)
    finally:
        lib.ncclEpGroupDestroy(group)


def low_latency_captured(lib, comm, cuda, stream, p, chk, rng, staged=False, idx32=False, replays=3):
    """NCCL EP 0.1's decode pattern: an eager expert-major round trip; then dispatch and combine
    captured into a CUDA graph and the graph launched ``replays`` times, each with fresh tokens,
    routing and weights refilled in place (the combine's input: the experts' outputs for that
    routing, computed here: one rank receives an expert's tokens in token order); then an eager
    round trip (the group now numbers its operations on the device) and one replay more. Every
    round's outputs are poisoned first and checked against the reference."""
    E, M, H, K, B = p.E, p.M, p.H, p.K, p.B
    L, R = E, 1
    cfg = nccl_ep.ncclEpGroupConfig_t(
        algorithm=NCCL_EP_ALGO_LOW_LATENCY, num_experts=E, max_dispatch_tokens_per_rank=M, max_token_bytes=2 * H
    )
    group = lib.ncclEpCreateGroup(comm, cfg)
    graph = None
    try:
        x_d = cuda.alloc(B * H * 2)
        idx_d = cuda.alloc(B * K * (4 if idx32 else 8))
        w_d = cuda.alloc(B * K * 4)
        recv_d = cuda.alloc(L * R * M * H * 2)
        counts_d = cuda.alloc(L * 4)
        y_in_d = cuda.alloc(L * R * M * H * 2)
        out_d = cuda.alloc(B * H * 2)

        def prepare(q):
            cuda.write(x_d, q.flat("H", q.x))
            cuda.write(idx_d, q.flat("i" if idx32 else "q", q.idx))
            cuda.write(w_d, q.flat("f", q.w))
            y_in = array.array("H", bytes(L * R * M * H * 2))
            for e in range(L):
                for j, t in enumerate(q.tokens_of(e)):
                    y_in[(e * R * M + j) * H:(e * R * M + j + 1) * H] = array.array("H", q.expert(e, q.x[t]))
            cuda.write(y_in_d, y_in)
            for ptr, n in ((recv_d, L * R * M * H * 2), (counts_d, L * 4), (out_d, B * H * 2)):
                cuda.check("cuMemsetD8", cuda.lib.cuMemsetD8_v2(ptr, 0xA5, n))

        topk = desc(idx_d, ncclInt32 if idx32 else ncclInt64, (B, K))
        prepare(p)
        handle = lib.ncclEpCreateHandle(group, NCCL_EP_LAYOUT_EXPERT_MAJOR, topk, None, None, stream)
        try:

            def enqueue():
                din = nccl_ep.ncclEpDispatchInputs_t(tokens=desc(x_d, ncclBfloat16, (B, H)))
                dout = nccl_ep.ncclEpDispatchOutputs_t(tokens=desc(recv_d, ncclBfloat16, (L, R * M, H)))
                info = nccl_ep.ncclEpLayoutInfo_t(expert_counters=desc(counts_d, ncclInt32, (L,)))
                lib.ncclEpDispatch(handle, din, dout, info, nccl_ep.ncclEpDispatchConfig_t(send_only=int(staged)), stream)
                if staged:
                    lib.ncclEpComplete(handle, None, stream)
                cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(y_in_d, ncclBfloat16, (L, R * M, H)))
                cout = nccl_ep.ncclEpCombineOutputs_t(
                    tokens=desc(out_d, ncclBfloat16, (B, H)), topk_weights=desc(w_d, ncclFloat32, (B, K))
                )
                lib.ncclEpCombine(handle, cin, cout, nccl_ep.ncclEpCombineConfig_t(send_only=int(staged)), stream)
                if staged:
                    lib.ncclEpComplete(handle, None, stream)

            def check(q, what):
                cuda.sync(stream)
                counts = cuda.download(counts_d, "i", L)
                recv = cuda.download(recv_d, "H", L * R * M * H)
                for e in range(L):
                    toks = q.tokens_of(e)
                    chk.expect(counts[e] == len(toks), "%s: expert %d received %d rows, expected %d" % (what, e, counts[e], len(toks)))
                    got = [list(recv[(e * R * M + j) * H:(e * R * M + j + 1) * H]) for j in range(len(toks))]
                    chk.expect(got == [q.x[t] for t in toks], "%s: expert %d: the received rows are not its tokens in token order" % (what, e))
                out = cuda.download(out_d, "H", B * H)
                for t in range(B):
                    chk.close(out[t * H:(t + 1) * H], q.weighted(t), "%s: combine, token %d" % (what, t))

            enqueue()
            check(p, "eager, before the capture")
            graph = cuda.capture(stream, enqueue)
            for i in range(replays + 2):
                q = Problem(rng, E, M, H, K, tokens=B)
                prepare(q)
                if i == replays:
                    enqueue()  # eager, numbered on the device now
                    check(q, "eager, after %d replays" % replays)
                    continue
                cuda.launch_graph(graph[1], stream)
                check(q, "replay %d" % i)
        finally:
            lib.ncclEpHandleDestroy(handle)
    finally:
        if graph is not None:
            cuda.destroy_graph(*graph)
        lib.ncclEpGroupDestroy(group)


def low_latency_forwarded(lib, comm, cuda, stream, p, chk, staged, fp4=False):
    """API v2's FWD recipe, expert-major, one rank: random bytes as e4m3 rows ``[B, H]`` with
    four fp32 scales each, or packed FP4 ``[B, H/2]`` with ``H/16`` uint8 scales; every expert
    must receive exactly its tokens' token and scale rows (as pairs), then the combine of zero
    expert outputs returns zeros."""
    E, M, H, K = p.E, p.M, p.H, p.K
    L, R = E, 1
    tok_type, tok_w, sc_type, sc_w, sc_size = (
        (nccl_ep.ncclFloat4x2, H // 2, nccl_ep.ncclUint8, H // 16, 1) if fp4 else (ncclFloat8e4m3, H, ncclFloat32, 4, 4)
    )
    tb, sb = tok_w, sc_w * sc_size
    rng = random.Random(p.B * 7919 + int(fp4))
    toks = [bytes(rng.getrandbits(8) for _ in range(tb)) for _ in range(p.B)]
    scs = [bytes(rng.getrandbits(8) for _ in range(sb)) for _ in range(p.B)]
    cfg = nccl_ep.ncclEpGroupConfig_t(
        algorithm=NCCL_EP_ALGO_LOW_LATENCY, num_experts=E, max_dispatch_tokens_per_rank=M, max_token_bytes=2 * H
    )
    group = lib.ncclEpCreateGroup(comm, cfg)
    try:
        x_d = cuda.upload(array.array("B", b"".join(toks)))
        xs_d = cuda.upload(array.array("B", b"".join(scs)))
        idx_d = cuda.upload(p.flat("q", p.idx))
        w_d = cuda.upload(p.flat("f", p.w))
        handle = lib.ncclEpCreateHandle(group, NCCL_EP_LAYOUT_EXPERT_MAJOR, desc(idx_d, ncclInt64, (p.B, K)), None, None, stream)
        try:
            recv_d = cuda.alloc(L * R * M * tb, fill=0xA5)
            rs_d = cuda.alloc(L * R * M * sb, fill=0xA5)
            counts_d = cuda.alloc(L * 4)
            din = nccl_ep.ncclEpDispatchInputs_t(
                tokens=desc(x_d, tok_type, (p.B, tok_w)), scales=desc(xs_d, sc_type, (p.B, sc_w))
            )
            dout = nccl_ep.ncclEpDispatchOutputs_t(
                tokens=desc(recv_d, tok_type, (L, R * M, tok_w)), scales=desc(rs_d, sc_type, (L, R * M, sc_w))
            )
            dcfg = nccl_ep.ncclEpDispatchConfig_v2_t(send_only=int(staged), quant_recipe=nccl_ep.NCCL_EP_DISP_QUANT_FWD)
            info = nccl_ep.ncclEpLayoutInfo_t(expert_counters=desc(counts_d, ncclInt32, (L,)))
            lib.ncclEpDispatch(handle, din, dout, info, dcfg, stream)
            if staged:
                lib.ncclEpComplete(handle, nccl_ep.ncclEpCompleteConfig_t(), stream)
            cuda.sync(stream)
            counts = cuda.download(counts_d, "i", L)
            recv = cuda.download(recv_d, "B", L * R * M * tb).tobytes()
            rs = cuda.download(rs_d, "B", L * R * M * sb).tobytes()
            for e in range(L):
                want = sorted((toks[t], scs[t]) for t in p.tokens_of(e))
                chk.expect(counts[e] == len(want), "FWD: expert %d received %d rows, expected %d" % (e, counts[e], len(want)))
                got = sorted(
                    (recv[(e * M + j) * tb:(e * M + j + 1) * tb], rs[(e * M + j) * sb:(e * M + j + 1) * sb])
                    for j in range(min(counts[e], M))
                )
                chk.expect(got == want, "FWD: expert %d: the received rows and scales are not its tokens' bytes" % e)
            y_in_d = cuda.alloc(L * R * M * H * 2)
            out_d = cuda.alloc(p.B * H * 2, fill=0xA5)
            cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(y_in_d, ncclBfloat16, (L, R * M, H)))
            cout = nccl_ep.ncclEpCombineOutputs_t(
                tokens=desc(out_d, ncclBfloat16, (p.B, H)), topk_weights=desc(w_d, ncclFloat32, (p.B, K))
            )
            lib.ncclEpCombine(handle, cin, cout, nccl_ep.ncclEpCombineConfig_t(send_only=int(staged)), stream)
            if staged:
                lib.ncclEpComplete(handle, None, stream)
            cuda.sync(stream)
            out = cuda.download(out_d, "H", p.B * H)
            chk.expect(all(v == 0 for v in out), "FWD: the combine of zero expert outputs is not zero")
        finally:
            lib.ncclEpHandleDestroy(handle)
    finally:
        lib.ncclEpGroupDestroy(group)


def low_latency_with_allocator(lib, comm, cuda, stream, p, chk):
    """The low-latency expert-major round trip (checked as without an allocator) on a group
    whose config gives ``alloc_fn`` / ``free_fn``: called at least once, and once the handle and
    the group are destroyed, ``free_fn`` was called as often as ``alloc_fn``, for every address
    and byte it handed out, each with the config's context."""
    a = CountingAllocator(cuda)
    low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=False, allocator=a)
    freed = a.wait_all_freed()
    print("  alloc_fn: %d calls, %d B; free_fn: %d calls, %d B" % (a.allocs, a.bytes_allocated, a.frees, a.bytes_freed))
    chk.expect(a.allocs >= 2, "alloc_fn: %d calls, expected the group's and the handle's" % a.allocs)
    chk.expect(freed, "%d allocations never came back through free_fn: %r" % (len(a.live), sorted(a.live.items())[:4]))
    chk.expect(a.frees == a.allocs, "free_fn: %d calls, alloc_fn: %d" % (a.frees, a.allocs))
    chk.expect(a.bytes_freed == a.bytes_allocated, "free_fn: %d B, alloc_fn: %d B" % (a.bytes_freed, a.bytes_allocated))
    chk.expect(not a.problems, "the allocator saw: %s" % "; ".join(a.problems[:4]))


def dispatch_info(global_ids, **counters):
    """The dispatch's layout info: API v1's, or with ``global_ids`` API v2's asking for GLOBAL
    expert ids (``rank * L + local``; one rank here, so the same values as LOCAL: this checks
    the call path, the ids' offsets are checked by the Rust GPU test
    ``global_expert_ids_gain_the_rank_offset_on_live_rows_only``)."""
    if global_ids:
        return nccl_ep.ncclEpLayoutInfo_v2_t(recv_topk_idx_kind=nccl_ep.NCCL_EP_EXPERT_ID_GLOBAL, **counters)
    return nccl_ep.ncclEpLayoutInfo_t(**counters) if counters else None


def low_latency_rank_major(lib, comm, cuda, stream, p, chk, global_ids=False):
    E, M, H, K = p.E, p.M, p.H, p.K
    R = 1
    cfg = nccl_ep.ncclEpGroupConfig_t(
        algorithm=NCCL_EP_ALGO_LOW_LATENCY, num_experts=E, max_dispatch_tokens_per_rank=M, max_token_bytes=2 * H
    )
    group = lib.ncclEpCreateGroup(comm, cfg)
    try:
        x_d = cuda.upload(p.flat("H", p.x))
        idx_d = cuda.upload(p.flat("q", p.idx))
        w_d = cuda.upload(p.flat("f", p.w))
        handle = lib.ncclEpCreateHandle(group, NCCL_EP_LAYOUT_RANK_MAJOR, desc(idx_d, ncclInt64, (p.B, K)), None, None, stream)
        try:
            recv_d = cuda.alloc(R * M * H * 2)
            rw_d = cuda.alloc(R * M * K * 4)
            ri_d = cuda.alloc(R * M * K * 4)
            cnt_d = cuda.alloc(R * 4)
            din = nccl_ep.ncclEpDispatchInputs_t(
                tokens=desc(x_d, ncclBfloat16, (p.B, H)), topk_weights=desc(w_d, ncclFloat32, (p.B, K))
            )
            dout = nccl_ep.ncclEpDispatchOutputs_t(
                tokens=desc(recv_d, ncclBfloat16, (R, M, H)),
                topk_weights=desc(rw_d, ncclFloat32, (R, M, K)),
                topk_idx=desc(ri_d, ncclInt32, (R, M, K)),
            )
            info = dispatch_info(global_ids, src_rank_counters=desc(cnt_d, ncclInt32, (R,)))
            lib.ncclEpDispatch(handle, din, dout, info, None, stream)
            cuda.sync(stream)
            n = cuda.download(cnt_d, "i", R)[0]
            sent = [t for t in range(p.B) if p.routed(t)]
            chk.expect(n == len(sent), "rank-major: %d tokens received, expected %d" % (n, len(sent)))
            recv = rows(cuda.download(recv_d, "H", R * M * H), R * M, H)
            rw = rows(cuda.download(rw_d, "f", R * M * K), R * M, K)
            ri = rows(cuda.download(ri_d, "i", R * M * K), R * M, K)
            by_row = {tuple(p.x[t]): t for t in sent}
            seen = set()
            reduced = array.array("H", bytes(R * M * H * 2))
            for j in range(min(n, R * M)):
                t = by_row.get(tuple(recv[j]))
                if not chk.expect(t is not None and t not in seen, "rank-major row %d is not one of the tokens sent (once)" % j):
                    continue
                seen.add(t)
                chk.expect(ri[j] == [e if e >= 0 else -1 for e in p.idx[t]], "rank-major row %d: ids %r, expected %r" % (j, ri[j], p.idx[t]))
                chk.expect(
                    all(rw[j][k] == p.w[t][k] for k in range(K) if p.idx[t][k] >= 0),
                    "rank-major row %d: weights %r, expected %r" % (j, rw[j], p.w[t]),
                )
                # The caller's expert step: weight and reduce over the local experts of the row.
                acc = [0.0] * H
                for k in range(K):
                    e = ri[j][k]
                    if e < 0:
                        continue
                    y = p.expert(e, recv[j])
                    for h in range(H):
                        acc[h] += rw[j][k] * bf16_val(y[h])
                reduced[j * H:(j + 1) * H] = array.array("H", [bf16_bits(v) for v in acc])
            y_d = cuda.upload(reduced)
            out_d = cuda.alloc(p.B * H * 2, fill=0xFF)
            cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(y_d, ncclBfloat16, (R, M, H)))
            cout = nccl_ep.ncclEpCombineOutputs_t(tokens=desc(out_d, ncclBfloat16, (p.B, H)))
            lib.ncclEpCombine(handle, cin, cout, None, stream)
            cuda.sync(stream)
            out = cuda.download(out_d, "H", p.B * H)
            for t in range(p.B):
                chk.close(out[t * H:(t + 1) * H], p.weighted(t), "LL rank-major combine, token %d" % t, rtol=2e-2)
        finally:
            lib.ncclEpHandleDestroy(handle)
    finally:
        lib.ncclEpGroupDestroy(group)


def high_throughput_group(lib, comm, cuda, p, max_recv):
    """A one-rank high-throughput group for problem ``p`` receiving at most ``max_recv`` rows,
    and ``p``'s tokens, routing and weights on the device."""
    cfg = nccl_ep.ncclEpGroupConfig_t(
        algorithm=NCCL_EP_ALGO_HIGH_THROUGHPUT,
        num_experts=p.E,
        max_dispatch_tokens_per_rank=p.M,
        max_recv_tokens_per_rank=max_recv,
        max_token_bytes=2 * p.H,
    )
    group = lib.ncclEpCreateGroup(comm, cfg)
    return group, cuda.upload(p.flat("H", p.x)), cuda.upload(p.flat("q", p.idx)), cuda.upload(p.flat("f", p.w))


def high_throughput_flat(lib, comm, cuda, stream, p, chk, global_ids=False):
    M, H, K = p.M, p.H, p.K
    R = 1
    group, x_d, idx_d, w_d = high_throughput_group(lib, comm, cuda, p, R * M)
    try:
        total_d = cuda.alloc(4)
        info = nccl_ep.ncclEpLayoutInfo_t(recv_total_counter=desc(total_d, ncclInt32, (1,)))
        handle = lib.ncclEpCreateHandle(group, NCCL_EP_LAYOUT_FLAT, desc(idx_d, ncclInt64, (p.B, K)), info, None, stream)
        try:
            cuda.sync(stream)
            n = cuda.download(total_d, "i", 1)[0]
            sent = [t for t in range(p.B) if p.routed(t)]
            chk.expect(n == len(sent), "flat: recv_total_counter %d, expected %d" % (n, len(sent)))
            slots = n + 3  # a few rows more than needed: the library marks them unused
            recv_d = cuda.alloc(slots * H * 2)
            rw_d = cuda.alloc(slots * K * 4)
            ri_d = cuda.alloc(slots * K * 8)
            din = nccl_ep.ncclEpDispatchInputs_t(
                tokens=desc(x_d, ncclBfloat16, (p.B, H)), topk_weights=desc(w_d, ncclFloat32, (p.B, K))
            )
            dout = nccl_ep.ncclEpDispatchOutputs_t(
                tokens=desc(recv_d, ncclBfloat16, (slots, H)),
                topk_weights=desc(rw_d, ncclFloat32, (slots, K)),
                topk_idx=desc(ri_d, ncclInt64, (slots, K)),
            )
            lib.ncclEpDispatch(handle, din, dout, dispatch_info(global_ids), None, stream)
            cuda.sync(stream)
            recv = rows(cuda.download(recv_d, "H", slots * H), slots, H)
            rw = rows(cuda.download(rw_d, "f", slots * K), slots, K)
            ri = rows(cuda.download(ri_d, "q", slots * K), slots, K)
            by_row = {tuple(p.x[t]): t for t in sent}
            seen = set()
            reduced = array.array("H", bytes(slots * H * 2))
            for j in range(n):
                t = by_row.get(tuple(recv[j]))
                if not chk.expect(t is not None and t not in seen, "flat row %d is not one of the tokens sent (once)" % j):
                    continue
                seen.add(t)
                chk.expect(ri[j] == p.idx[t], "flat row %d: ids %r, expected %r" % (j, ri[j], p.idx[t]))
                chk.expect(
                    all(rw[j][k] == p.w[t][k] for k in range(K) if p.idx[t][k] >= 0),
                    "flat row %d: weights %r, expected %r" % (j, rw[j], p.w[t]),
                )
                acc = [0.0] * H
                for k in range(K):
                    if ri[j][k] < 0:
                        continue
                    y = p.expert(ri[j][k], recv[j])
                    for h in range(H):
                        acc[h] += rw[j][k] * bf16_val(y[h])
                reduced[j * H:(j + 1) * H] = array.array("H", [bf16_bits(v) for v in acc])
            for j in range(n, slots):
                chk.expect(ri[j] == [-1] * K and rw[j] == [0.0] * K, "flat unused row %d: ids %r weights %r" % (j, ri[j], rw[j]))
            y_d = cuda.upload(reduced)
            out_d = cuda.alloc(p.B * H * 2)
            cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(y_d, ncclBfloat16, (slots, H)))
            cout = nccl_ep.ncclEpCombineOutputs_t(tokens=desc(out_d, ncclBfloat16, (p.B, H)))
            lib.ncclEpCombine(handle, cin, cout, None, stream)
            cuda.sync(stream)
            out = cuda.download(out_d, "H", p.B * H)
            for t in range(p.B):
                chk.close(out[t * H:(t + 1) * H], p.weighted(t), "HT flat combine, token %d" % t, rtol=2e-2)
        finally:
            lib.ncclEpHandleDestroy(handle)
    finally:
        lib.ncclEpGroupDestroy(group)


def high_throughput_expert_major(lib, comm, cuda, stream, p, chk, alignment=4, backward=False):
    """NCCL EP's high-throughput EXPERT_MAJOR layout (one rank: every expert local): the handle's
    padded counts, zone offsets and slot total; each zone holds its expert's tokens in token
    order with their weights, padding zero; the combine sums every slot of a token. With
    ``backward``, then the backward pass on the handle: a backward dispatch of fresh gradients
    lands in the same slots (padding zero), and a backward combine of those slots with a
    weight gradient per slot returns each token's slots summed and, per entry, its slot's
    weight gradient."""
    M, H, K = p.M, p.H, p.K
    L = p.E
    group, x_d, idx_d, w_d = high_throughput_group(lib, comm, cuda, p, M * K)
    try:
        counts_d, offsets_d, total_d = cuda.alloc(L * 8), cuda.alloc(L * 8), cuda.alloc(8)
        info = nccl_ep.ncclEpLayoutInfo_t(
            expert_counters=desc(counts_d, ncclInt64, (L,)),
            expert_offsets=desc(offsets_d, ncclInt64, (L,)),
            recv_total_counter=desc(total_d, ncclInt64, (1,)),
        )
        hcfg = nccl_ep.ncclEpHandleConfig_t(dispatch_output_per_expert_alignment=alignment)
        handle = lib.ncclEpCreateHandle(group, NCCL_EP_LAYOUT_EXPERT_MAJOR, desc(idx_d, ncclInt64, (p.B, K)), info, hcfg, stream)
        try:
            cuda.sync(stream)
            counts = list(cuda.download(counts_d, "q", L))
            offsets = list(cuda.download(offsets_d, "q", L))
            total = cuda.download(total_d, "q", 1)[0]
            zones = [p.tokens_of(e) for e in range(L)]
            pad = [(len(z) + alignment - 1) // alignment * alignment for z in zones]
            chk.expect(counts == pad, "EM: padded counts %r, expected %r" % (counts, pad))
            chk.expect(offsets == [sum(pad[:e]) for e in range(L)], "EM: offsets %r" % (offsets,))
            chk.expect(total == sum(pad), "EM: total %d, expected %d" % (total, sum(pad)))
            slots = total + 3  # a few slots more than needed
            recv_d = cuda.alloc(slots * H * 2, fill=0xA5)
            rw_d = cuda.alloc(slots * 4, fill=0xA5)
            din = nccl_ep.ncclEpDispatchInputs_t(
                tokens=desc(x_d, ncclBfloat16, (p.B, H)), topk_weights=desc(w_d, ncclFloat32, (p.B, K))
            )
            dout = nccl_ep.ncclEpDispatchOutputs_t(
                tokens=desc(recv_d, ncclBfloat16, (slots, H)), topk_weights=desc(rw_d, ncclFloat32, (slots,))
            )
            lib.ncclEpDispatch(handle, din, dout, None, None, stream)
            cuda.sync(stream)
            recv = rows(cuda.download(recv_d, "H", slots * H), slots, H)
            rw = cuda.download(rw_d, "f", slots)
            y = array.array("H", bytes(slots * H * 2))
            for e in range(L):
                for j, t in enumerate(zones[e]):
                    s = offsets[e] + j
                    k = p.idx[t].index(e)
                    chk.expect(recv[s] == p.x[t], "EM: expert %d slot %d is not token %d" % (e, j, t))
                    chk.expect(rw[s] == p.w[t][k], "EM: expert %d slot %d weight %r, expected %r" % (e, j, rw[s], p.w[t][k]))
                    # The caller's expert output for the slot, weighted (the combine only sums).
                    y[s * H:(s + 1) * H] = array.array("H", [bf16_bits(p.w[t][k] * bf16_val(v)) for v in p.expert(e, recv[s])])
                for s in range(offsets[e] + len(zones[e]), offsets[e] + pad[e]):
                    chk.expect(recv[s] == [0] * H and rw[s] == 0.0, "EM: expert %d pad slot %d is not zero" % (e, s))
            y_d = cuda.upload(y)
            out_d = cuda.alloc(p.B * H * 2, fill=0xFF)
            cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(y_d, ncclBfloat16, (slots, H)))
            cout = nccl_ep.ncclEpCombineOutputs_t(tokens=desc(out_d, ncclBfloat16, (p.B, H)))
            lib.ncclEpCombine(handle, cin, cout, None, stream)
            cuda.sync(stream)
            out = cuda.download(out_d, "H", p.B * H)
            for t in range(p.B):
                if p.routed(t):
                    chk.close(out[t * H:(t + 1) * H], p.weighted(t), "HT expert-major combine, token %d" % t, rtol=2e-2)
            if backward:
                expert_major_backward(lib, cuda, stream, p, chk, handle, zones, offsets, pad, slots)
        finally:
            lib.ncclEpHandleDestroy(handle)
    finally:
        lib.ncclEpGroupDestroy(group)


def high_throughput_forwarded(lib, comm, cuda, stream, p, chk, expert_major=False, fp4=False):
    """API v2's FWD recipe in a high-throughput group, one rank: random bytes as e4m3 rows
    ``[B, H]`` with four fp32 scales each, or packed FP4 ``[B, H/2]`` with ``H/16`` uint8 scales.
    Flat: every routed token's token and scale rows once (as pairs), with its ids, in outputs of
    a few rows more than the group's receive budget. Expert-major (zones aligned to 4): each zone
    holds its expert's tokens' rows in token order with their weights, the padding zero. Then
    the combine of zero expert outputs returns zeros."""
    M, H, K, L = p.M, p.H, p.K, p.E
    tok_type, tok_w, sc_type, sc_w, sc_size = (
        (nccl_ep.ncclFloat4x2, H // 2, nccl_ep.ncclUint8, H // 16, 1) if fp4 else (ncclFloat8e4m3, H, ncclFloat32, 4, 4)
    )
    tb, sb = tok_w, sc_w * sc_size
    rng = random.Random(p.B * 7919 + 2 * int(fp4) + int(expert_major))
    toks = [bytes(rng.getrandbits(8) for _ in range(tb)) for _ in range(p.B)]
    scs = [bytes(rng.getrandbits(8) for _ in range(sb)) for _ in range(p.B)]
    group, _, idx_d, w_d = high_throughput_group(lib, comm, cuda, p, M * K)
    try:
        x_d = cuda.upload(array.array("B", b"".join(toks)))
        xs_d = cuda.upload(array.array("B", b"".join(scs)))
        total_d = cuda.alloc(8)
        info = nccl_ep.ncclEpLayoutInfo_t(recv_total_counter=desc(total_d, ncclInt64, (1,)))
        layout, hcfg = NCCL_EP_LAYOUT_FLAT, None
        if expert_major:
            layout, hcfg = NCCL_EP_LAYOUT_EXPERT_MAJOR, nccl_ep.ncclEpHandleConfig_t(dispatch_output_per_expert_alignment=4)
        handle = lib.ncclEpCreateHandle(group, layout, desc(idx_d, ncclInt64, (p.B, K)), info, hcfg, stream)
        try:
            cuda.sync(stream)
            n = cuda.download(total_d, "q", 1)[0]
            # A few rows more than needed: the zones' slots (expert-major), the group's receive
            # budget (flat: NCCL EP's FWD outputs hold it).
            slots = (n if expert_major else max(n, M * K)) + 3
            recv_d = cuda.alloc(slots * tb, fill=0xA5)
            rs_d = cuda.alloc(slots * sb, fill=0xA5)
            rw_d = cuda.alloc(slots * (1 if expert_major else K) * 4, fill=0xA5)
            ri_d = cuda.alloc(slots * K * 8)
            din = nccl_ep.ncclEpDispatchInputs_t(
                tokens=desc(x_d, tok_type, (p.B, tok_w)),
                scales=desc(xs_d, sc_type, (p.B, sc_w)),
                topk_weights=desc(w_d, ncclFloat32, (p.B, K)),
            )
            dout = nccl_ep.ncclEpDispatchOutputs_t(
                tokens=desc(recv_d, tok_type, (slots, tok_w)),
                scales=desc(rs_d, sc_type, (slots, sc_w)),
                topk_weights=desc(rw_d, ncclFloat32, (slots,) if expert_major else (slots, K)),
                topk_idx=None if expert_major else desc(ri_d, ncclInt64, (slots, K)),
            )
            dcfg = nccl_ep.ncclEpDispatchConfig_v2_t(quant_recipe=nccl_ep.NCCL_EP_DISP_QUANT_FWD)
            lib.ncclEpDispatch(handle, din, dout, None, dcfg, stream)
            cuda.sync(stream)
            recv = cuda.download(recv_d, "B", slots * tb).tobytes()
            rs = cuda.download(rs_d, "B", slots * sb).tobytes()
            pair = lambda j: (recv[j * tb:(j + 1) * tb], rs[j * sb:(j + 1) * sb])  # noqa: E731
            if expert_major:
                rw = cuda.download(rw_d, "f", slots)
                off = 0
                for e in range(L):
                    zone = p.tokens_of(e)
                    for j, t in enumerate(zone):
                        chk.expect(pair(off + j) == (toks[t], scs[t]), "HT EM FWD: expert %d slot %d is not token %d's bytes" % (e, j, t))
                        chk.expect(rw[off + j] == p.w[t][p.idx[t].index(e)], "HT EM FWD: expert %d slot %d weight" % (e, j))
                    padded = (len(zone) + 3) // 4 * 4
                    for j in range(len(zone), padded):
                        chk.expect(pair(off + j) == (bytes(tb), bytes(sb)) and rw[off + j] == 0.0, "HT EM FWD: expert %d pad slot %d is not zero" % (e, j))
                    off += padded
                chk.expect(off == n, "HT EM FWD: %d slots, recv_total_counter %d" % (off, n))
            else:
                ri = rows(cuda.download(ri_d, "q", slots * K), slots, K)
                sent = [t for t in range(p.B) if p.routed(t)]
                chk.expect(n == len(sent), "HT flat FWD: recv_total_counter %d, expected %d" % (n, len(sent)))
                by_pair = {(toks[t], scs[t]): t for t in sent}
                seen = set()
                for j in range(n):
                    t = by_pair.get(pair(j))
                    if chk.expect(t is not None and t not in seen, "HT flat FWD: row %d is not one token's bytes (once)" % j):
                        seen.add(t)
                        chk.expect(ri[j] == p.idx[t], "HT flat FWD: row %d ids %r, expected %r" % (j, ri[j], p.idx[t]))
            y_d = cuda.alloc(slots * H * 2)
            out_d = cuda.alloc(p.B * H * 2, fill=0xA5)
            cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(y_d, ncclBfloat16, (slots, H)))
            cout = nccl_ep.ncclEpCombineOutputs_t(tokens=desc(out_d, ncclBfloat16, (p.B, H)))
            lib.ncclEpCombine(handle, cin, cout, None, stream)
            cuda.sync(stream)
            out = cuda.download(out_d, "H", p.B * H)
            chk.expect(all(v == 0 for v in out), "HT FWD: the combine of zero expert outputs is not zero")
        finally:
            lib.ncclEpHandleDestroy(handle)
    finally:
        lib.ncclEpGroupDestroy(group)


def expert_major_backward(lib, cuda, stream, p, chk, handle, zones, offsets, pad, slots):
    """The backward pass on a high-throughput expert-major handle a forward dispatch numbered:
    see ``high_throughput_expert_major``."""
    H, K, L = p.H, p.K, p.E
    rng = random.Random(p.B * 31 + slots)
    grads = [[bf16_bits(rng.uniform(-1.0, 1.0)) for _ in range(H)] for _ in range(p.B)]
    g_d = cuda.upload(p.flat("H", grads))
    recv_d = cuda.alloc(slots * H * 2, fill=0xA5)
    din = nccl_ep.ncclEpDispatchInputs_t(tokens=desc(g_d, ncclBfloat16, (p.B, H)))
    dout = nccl_ep.ncclEpDispatchOutputs_t(tokens=desc(recv_d, ncclBfloat16, (slots, H)))
    lib.ncclEpDispatch(handle, din, dout, None, nccl_ep.ncclEpDispatchConfig_t(pass_direction=nccl_ep.NCCL_EP_BWD_PASS), stream)
    cuda.sync(stream)
    recv = rows(cuda.download(recv_d, "H", slots * H), slots, H)
    slot_w = [struct.unpack("<f", struct.pack("<f", rng.uniform(-1.0, 1.0)))[0] for _ in range(slots)]
    for e in range(L):
        for j, t in enumerate(zones[e]):
            chk.expect(recv[offsets[e] + j] == grads[t], "EM backward dispatch: expert %d slot %d is not token %d's gradient" % (e, j, t))
        for s in range(offsets[e] + len(zones[e]), offsets[e] + pad[e]):
            chk.expect(recv[s] == [0] * H, "EM backward dispatch: expert %d pad slot %d is not zero" % (e, s))
    sw_d = cuda.upload(array.array("f", slot_w))
    out_d = cuda.alloc(p.B * H * 2, fill=0xA5)
    ow_d = cuda.alloc(p.B * K * 4, fill=0xA5)
    cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(recv_d, ncclBfloat16, (slots, H)), topk_weights=desc(sw_d, ncclFloat32, (slots,)))
    cout = nccl_ep.ncclEpCombineOutputs_t(tokens=desc(out_d, ncclBfloat16, (p.B, H)), topk_weights=desc(ow_d, ncclFloat32, (p.B, K)))
    lib.ncclEpCombine(handle, cin, cout, nccl_ep.ncclEpCombineConfig_t(pass_direction=nccl_ep.NCCL_EP_BWD_PASS), stream)
    cuda.sync(stream)
    out = cuda.download(out_d, "H", p.B * H)
    ow = rows(cuda.download(ow_d, "f", p.B * K), p.B, K)
    for t in range(p.B):
        want_w = [slot_w[offsets[e] + zones[e].index(t)] if e >= 0 else 0.0 for e in p.idx[t]]
        chk.expect(ow[t] == want_w, "EM backward combine: token %d weight gradients %r, expected %r" % (t, ow[t], want_w))
        want = [len(p.routed(t)) * bf16_val(v) for v in grads[t]]
        chk.close(out[t * H:(t + 1) * H], want, "EM backward combine: token %d" % t, rtol=2e-2)


def torch_expert_major(lib, comm, p, chk):
    import torch
    from nccl_ep.torch_ep import EpGroup

    dev = torch.device("cuda", lib.ncclCommCuDevice(comm))
    signed = [[b - 0x10000 if b >= 0x8000 else b for b in row] for row in p.x]
    x = torch.tensor(signed, dtype=torch.int16).view(torch.bfloat16).to(dev)
    idx = torch.tensor(p.idx, dtype=torch.int64, device=dev)
    w = torch.tensor(p.w, dtype=torch.float32, device=dev)
    with EpGroup(lib, comm, num_experts=p.E, max_tokens_per_rank=p.M, hidden=p.H) as g:
        with g.create_handle(idx) as h:
            d = h.dispatch(x)
            counts = d.expert_counts.cpu().tolist()
            scales = torch.tensor([p.scale(e) for e in range(p.E)], device=dev).view(-1, 1, 1)
            y = (d.tokens.float() * scales).to(torch.bfloat16)
            out = h.combine(y, topk_weights=w)
            torch.cuda.synchronize(dev)
    for e in range(p.E):
        chk.expect(counts[e] == len(p.tokens_of(e)), "torch: expert %d count %d, expected %d" % (e, counts[e], len(p.tokens_of(e))))
    bits = out.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).cpu().tolist()
    for t in range(p.B):
        chk.close(bits[t], p.weighted(t), "torch EpHandle combine, token %d" % t)


def torch_captured(lib, comm, p, chk, rng, replays=3):
    """The decode pattern of PyTorch servers: one MoE step (dispatch, the experts in PyTorch,
    combine) captured with ``torch.cuda.graph`` and replayed with the routing, tokens and weights
    refilled in place (``copy_``), each replay against the reference, after an eager step."""
    import torch
    from nccl_ep.torch_ep import EpGroup

    dev = torch.device("cuda", lib.ncclCommCuDevice(comm))

    def tensors(q):
        signed = [[b - 0x10000 if b >= 0x8000 else b for b in row] for row in q.x]
        return (
            torch.tensor(signed, dtype=torch.int16).view(torch.bfloat16).to(dev),
            torch.tensor(q.idx, dtype=torch.int64, device=dev),
            torch.tensor(q.w, dtype=torch.float32, device=dev),
        )

    x, idx, w = tensors(p)
    scales = torch.tensor([p.scale(e) for e in range(p.E)], device=dev).view(-1, 1, 1)

    def check(q, d, out, what):
        counts = d.expert_counts.cpu().tolist()
        for e in range(q.E):
            chk.expect(counts[e] == len(q.tokens_of(e)), "%s: expert %d count %d, expected %d" % (what, e, counts[e], len(q.tokens_of(e))))
        bits = out.view(torch.int16).to(torch.int32).bitwise_and(0xFFFF).cpu().tolist()
        for t in range(q.B):
            chk.close(bits[t], q.weighted(t), "%s: combine, token %d" % (what, t))

    with EpGroup(lib, comm, num_experts=p.E, max_tokens_per_rank=p.M, hidden=p.H) as g:
        with g.create_handle(idx) as h:

            def step():
                d = h.dispatch(x)
                y = (d.tokens.float() * scales).to(torch.bfloat16)
                return d, h.combine(y, topk_weights=w)

            d, out = step()
            torch.cuda.synchronize(dev)
            check(p, d, out, "torch eager step")
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                d, out = step()
            for i in range(replays):
                q = Problem(rng, p.E, p.M, p.H, p.K, tokens=p.B)
                for dst, src in zip((x, idx, w), tensors(q)):
                    dst.copy_(src)
                out.fill_(0)
                graph.replay()
                torch.cuda.synchronize(dev)
                check(q, d, out, "torch.cuda.graph replay %d" % i)
            del graph


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=None, help="replay a run (default: a fresh seed)")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--require-gpu", action="store_true", help="exit 2 instead of 0 when there is no GPU")
    args = ap.parse_args()

    if gpu_count() == 0:
        print("SKIPPED: no CUDA GPU (libcuda.so.1 missing or no device): the Python round trip did not run")
        return 2 if args.require_gpu else 0
    if not nccl_ep.HAVE_NCCL_EP:
        print("FAIL: %s" % nccl_ep.NCCL_EP_LOAD_MESSAGE)
        return 1
    lib = nccl_ep.NCCLLibrary()
    print("library: %r" % lib)
    if not lib.have_nccl:
        print("FAIL: NCCL (libnccl.so.2) was not found to make a communicator: set EPFLOW_NCCL_LIB or NCCL_HOME")
        return 1
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print("seed %d (replay with --seed %d); NCCL %d; EP version %d" % (seed, seed, lib.ncclGetVersion(), lib.ncclEpGetVersion()))
    rng = random.Random(seed)

    cuda = Cuda(args.device)
    uid = lib.ncclGetUniqueId()
    comm = lib.ncclCommInitRank(1, uid, 0)
    chk = Checker()
    stream = cuda.stream()
    cases = [
        ("LL expert-major", lambda p: low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=False)),
        ("LL expert-major, send_only + ncclEpComplete", lambda p: low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=True)),
        (
            "LL expert-major, DS_FP8E3M4 (API v2)",
            lambda p: low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=False, fp8=True),
        ),
        (
            "LL expert-major, DS_FP8E3M4, send_only (API v2)",
            lambda p: low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=True, fp8=True),
        ),
        (
            "LL expert-major, DS_FP8E3M4, scales 4 B into their allocation",
            lambda p: low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=False, fp8=True, scales_offset=4),
        ),
        (
            "LL expert-major, int32 topk_idx (API v2)",
            lambda p: low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=False, idx32=True),
        ),
        (
            "LL expert-major, FWD e4m3 + fp32 scales (API v2)",
            lambda p: low_latency_forwarded(lib, comm, cuda, stream, p, chk, staged=False),
        ),
        (
            "LL expert-major, FWD fp4x2 + uint8, send_only (API v2)",
            lambda p: low_latency_forwarded(lib, comm, cuda, stream, p, chk, staged=True, fp4=True),
        ),
        (
            "LL expert-major, NVFP4 combine (API v2)",
            lambda p: low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=False, nvfp4=True),
        ),
        (
            "LL expert-major, NVFP4 combine, send_only (API v2)",
            lambda p: low_latency_expert_major(lib, comm, cuda, stream, p, chk, staged=True, nvfp4=True),
        ),
        (
            "LL expert-major, CUDA graph: 4 replays + eager",
            lambda p: low_latency_captured(lib, comm, cuda, stream, p, chk, rng),
        ),
        (
            "LL expert-major, CUDA graph, send_only",
            lambda p: low_latency_captured(lib, comm, cuda, stream, p, chk, rng, staged=True),
        ),
        (
            "LL expert-major, CUDA graph, int32 topk_idx",
            lambda p: low_latency_captured(lib, comm, cuda, stream, p, chk, rng, idx32=True),
        ),
        ("LL expert-major, alloc_fn / free_fn", lambda p: low_latency_with_allocator(lib, comm, cuda, stream, p, chk)),
        ("LL rank-major", lambda p: low_latency_rank_major(lib, comm, cuda, stream, p, chk)),
        ("HT flat", lambda p: high_throughput_flat(lib, comm, cuda, stream, p, chk)),
        (
            "LL rank-major, GLOBAL expert ids (API v2)",
            lambda p: low_latency_rank_major(lib, comm, cuda, stream, p, chk, global_ids=True),
        ),
        ("HT flat, GLOBAL expert ids (API v2)", lambda p: high_throughput_flat(lib, comm, cuda, stream, p, chk, global_ids=True)),
        ("HT expert-major, zones aligned to 4", lambda p: high_throughput_expert_major(lib, comm, cuda, stream, p, chk)),
        ("HT expert-major, no alignment", lambda p: high_throughput_expert_major(lib, comm, cuda, stream, p, chk, alignment=1)),
        (
            "HT expert-major, forward then backward",
            lambda p: high_throughput_expert_major(lib, comm, cuda, stream, p, chk, backward=True),
        ),
        (
            "HT flat, FWD e4m3 + fp32 scales (API v2)",
            lambda p: high_throughput_forwarded(lib, comm, cuda, stream, p, chk),
        ),
        (
            "HT expert-major, FWD fp4x2 + uint8 (API v2)",
            lambda p: high_throughput_forwarded(lib, comm, cuda, stream, p, chk, expert_major=True, fp4=True),
        ),
    ]
    try:
        import torch  # noqa: F401

        cases.append(("torch_ep LL expert-major", lambda p: torch_expert_major(lib, comm, p, chk)))
        cases.append(("torch_ep LL expert-major, torch.cuda.graph", lambda p: torch_captured(lib, comm, p, chk, rng)))
    except ImportError:
        print("SKIPPED: torch_ep case (PyTorch is not importable)")
    errors = 0
    try:
        for name, case in cases:
            p = Problem(rng, args.experts, args.max_tokens, args.hidden, args.top_k)
            before = chk.failures
            t0 = time.time()
            err = False
            try:
                case(p)
            except Exception as e:  # a refused call is a failure of this case, the others still run
                errors += 1
                err = True
                print("  ERROR: %s: %s" % (type(e).__name__, e))
            status = "ok" if chk.failures == before and not err else "FAILED"
            print("%-45s B=%d E=%d H=%d K=%d  %s (%.1f s)" % (name, p.B, p.E, p.H, p.K, status, time.time() - t0))
    finally:
        cuda.free_all()
        lib.ncclCommDestroy(comm)
    failed = chk.failures + errors
    print("%d checks, %d failed, %d errors (seed %d)" % (chk.checks, chk.failures, errors, seed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

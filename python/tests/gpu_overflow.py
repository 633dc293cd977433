#!/usr/bin/env python3
"""API v2's ``overflow_policy = NCCL_EP_OVERFLOW_DROP`` through the ``nccl_ep`` package, on R
ranks (R processes; they may share one GPU: rank r runs on GPU r % GPUs, and NCCL takes ranks
sharing a GPU with ``NCCL_MULTI_RANK_GPU_ENABLE=1``, which this script sets)::

    EPFLOW_LIB=target/release/libnccl_ep.so python3 python/tests/gpu_overflow.py --ranks 2

A high-throughput group whose receive budget ``max_recv_tokens_per_rank`` is M rows, and a
routing that sends every token of every rank to rank 0's experts: rank 0 dispatches M/2 tokens,
the others M each, so rank 0 receives M/2 + (R-1)M rows, more than M. Checked against a CPU
reference computed here from fresh random inputs (the seed is printed; ``--seed`` replays one):

- ``recv_total_counter``: the true count on rank 0 (M/2 + (R-1)M), 0 elsewhere;
- rank 0's M output rows: the first M rows in the flat order (source rank, then its tokens), so
  its own M/2 tokens and rank 1's first M/2, with their local expert ids and weights;
- the combine, on every rank: each kept token's weighted sum of its experts' outputs, zeros for
  every dropped token (all its experts are on rank 0, which dropped its row);
- a second dispatch on the handle with API v2's FWD recipe (random bytes as e4m3 rows with 16
  uint8 scales each): rank 0's M rows are the kept rows' token and scale bytes, with their ids.

Without a GPU it prints ``SKIPPED`` and exits 0 (exit 2 with ``--require-gpu``). Any mismatch,
error or rank that does not finish within ``--timeout`` seconds exits 1.
"""

import argparse
import array
import ctypes
import os
import random
import struct
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the source tree's nccl_ep when not installed
sys.path.insert(0, HERE)

import nccl_ep  # noqa: E402
from nccl_ep import NCCL_EP_ALGO_HIGH_THROUGHPUT, NCCL_EP_LAYOUT_FLAT, ncclBfloat16, ncclFloat8e4m3, ncclFloat32, ncclInt32, ncclInt64, ncclUint8  # noqa: E402
from nccl_ep.structs import ncclUniqueId  # noqa: E402

from gpu_roundtrip import Checker, Cuda, bf16_bits, bf16_val, desc, gpu_count, rows  # noqa: E402


class RankInputs:
    """Rank ``r``'s tokens (BF16 bits), routing (K distinct experts of rank 0's ``L``) and fp32
    weights; every process makes every rank's from the seed."""

    def __init__(self, seed, r, tokens, hidden, local_experts, top_k):
        rng = random.Random(seed * 1009 + r)
        self.B = tokens
        self.x = [[bf16_bits(rng.uniform(-2.0, 2.0)) for _ in range(hidden)] for _ in range(tokens)]
        self.idx = [rng.sample(range(local_experts), top_k) for _ in range(tokens)]
        self.w = [[struct.unpack("<f", struct.pack("<f", rng.uniform(0.05, 1.0)))[0] for _ in range(top_k)] for _ in range(tokens)]
        # API v2's FWD recipe: e4m3 rows [B, H] and 16 uint8 scales per row, random bytes.
        self.q = [bytes(rng.getrandbits(8) for _ in range(hidden)) for _ in range(tokens)]
        self.s = [bytes(rng.getrandbits(8) for _ in range(16)) for _ in range(tokens)]


def expert(e, row_bits):
    """Expert ``e``'s output row (BF16 bits): the input times (e + 1) / 8."""
    return [bf16_bits(bf16_val(b) * (e + 1) / 8.0) for b in row_bits]


def weighted(inp, t):
    """sum_k w[t,k] * expert(idx[t,k], x[t]) in fp32: what the combine returns for a kept token."""
    acc = [0.0] * len(inp.x[t])
    for k, e in enumerate(inp.idx[t]):
        y = expert(e, inp.x[t])
        for h in range(len(acc)):
            acc[h] += inp.w[t][k] * bf16_val(y[h])
    return acc


def flat(typecode, table):
    out = array.array(typecode)
    for r in table:
        out.extend(r)
    return out


def rank_main(args):
    rank, R = args.child, args.ranks
    M, H, K, L = args.max_tokens, args.hidden, args.top_k, args.local_experts
    E = L * R
    lib = nccl_ep.NCCLLibrary()
    cuda = Cuda(rank % gpu_count())
    if rank == 0:
        uid = lib.ncclGetUniqueId()
        with open(args.uid_file + ".tmp", "wb") as f:
            f.write(bytes(uid))
        os.rename(args.uid_file + ".tmp", args.uid_file)
    else:
        deadline = time.time() + args.timeout
        while not os.path.exists(args.uid_file):
            if time.time() > deadline:
                raise RuntimeError("rank 0 wrote no unique id")
            time.sleep(0.05)
        with open(args.uid_file, "rb") as f:
            uid = ncclUniqueId.from_buffer_copy(f.read())
    comm = lib.ncclCommInitRank(R, uid, rank)
    inputs = [RankInputs(args.seed, r, M // 2 if r == 0 else M, H, L, K) for r in range(R)]
    mine = inputs[rank]
    chk = Checker()
    stream = cuda.stream()
    cfg = nccl_ep.v2.ncclEpGroupConfig_t(
        algorithm=NCCL_EP_ALGO_HIGH_THROUGHPUT,
        num_experts=E,
        max_dispatch_tokens_per_rank=M,
        max_recv_tokens_per_rank=M,
        max_token_bytes=2 * H,
        overflow_policy=nccl_ep.NCCL_EP_OVERFLOW_DROP,
    )
    group = lib.ncclEpCreateGroup(comm, cfg)
    try:
        x_d = cuda.upload(flat("H", mine.x))
        idx_d = cuda.upload(flat("q", mine.idx))
        w_d = cuda.upload(flat("f", mine.w))
        total_d = cuda.alloc(4)
        info = nccl_ep.ncclEpLayoutInfo_t(recv_total_counter=desc(total_d, ncclInt32, (1,)))
        handle = lib.ncclEpCreateHandle(group, NCCL_EP_LAYOUT_FLAT, desc(idx_d, ncclInt64, (mine.B, K)), info, None, stream)
        try:
            cuda.sync(stream)
            # Every row goes to rank 0, in the flat order: source rank, then its tokens.
            order = [(r, t) for r in range(R) for t in range(inputs[r].B)] if rank == 0 else []
            n = cuda.download(total_d, "i", 1)[0]
            chk.expect(n == len(order), "rank %d: recv_total_counter %d, expected %d (the count before the drop)" % (rank, n, len(order)))
            kept = order[:M]
            recv_d = cuda.alloc(M * H * 2, fill=0xAB)
            rw_d = cuda.alloc(M * K * 4)
            ri_d = cuda.alloc(M * K * 8)
            din = nccl_ep.ncclEpDispatchInputs_t(tokens=desc(x_d, ncclBfloat16, (mine.B, H)), topk_weights=desc(w_d, ncclFloat32, (mine.B, K)))
            dout = nccl_ep.ncclEpDispatchOutputs_t(
                tokens=desc(recv_d, ncclBfloat16, (M, H)),
                topk_weights=desc(rw_d, ncclFloat32, (M, K)),
                topk_idx=desc(ri_d, ncclInt64, (M, K)),
            )
            lib.ncclEpDispatch(handle, din, dout, None, None, stream)
            cuda.sync(stream)
            recv = rows(cuda.download(recv_d, "H", M * H), M, H)
            rw = rows(cuda.download(rw_d, "f", M * K), M, K)
            ri = rows(cuda.download(ri_d, "q", M * K), M, K)
            reduced = array.array("H", bytes(M * H * 2))
            for j, (r, t) in enumerate(kept):
                src = inputs[r]
                chk.expect(recv[j] == src.x[t], "rank 0 row %d: not rank %d's token %d (the first %d rows in flat order are kept)" % (j, r, t, M))
                chk.expect(ri[j] == src.idx[t], "rank 0 row %d: ids %r, expected %r" % (j, ri[j], src.idx[t]))
                chk.expect(rw[j] == src.w[t], "rank 0 row %d: weights %r, expected %r" % (j, rw[j], src.w[t]))
                acc = [0.0] * H
                for k in range(K):
                    y = expert(ri[j][k], recv[j])
                    for h in range(H):
                        acc[h] += rw[j][k] * bf16_val(y[h])
                reduced[j * H:(j + 1) * H] = array.array("H", [bf16_bits(v) for v in acc])
            y_d = cuda.upload(reduced)
            out_d = cuda.alloc(mine.B * H * 2, fill=0xAB)
            cin = nccl_ep.ncclEpCombineInputs_t(tokens=desc(y_d, ncclBfloat16, (M, H)))
            cout = nccl_ep.ncclEpCombineOutputs_t(tokens=desc(out_d, ncclBfloat16, (mine.B, H)))
            lib.ncclEpCombine(handle, cin, cout, None, stream)
            cuda.sync(stream)
            out = cuda.download(out_d, "H", mine.B * H)
            kept_here = {t for (r, t) in ([(r, t) for r in range(R) for t in range(inputs[r].B)][:M]) if r == rank}
            dropped = 0
            for t in range(mine.B):
                got = out[t * H:(t + 1) * H]
                if t in kept_here:
                    chk.close(got, weighted(mine, t), "rank %d combine, kept token %d" % (rank, t), rtol=2e-2)
                else:
                    dropped += 1
                    chk.expect(all(bf16_val(b) == 0.0 for b in got), "rank %d combine, dropped token %d: not zero" % (rank, t))
            print("rank %d: %d tokens, %d kept by rank 0, %d dropped; rank 0 received %d rows, budget %d"
                  % (rank, mine.B, len(kept_here), dropped, len(order) if rank == 0 else -1, M))
            # The FWD recipe on the same handle: the kept rows' bytes, token and scale rows.
            q_d = cuda.upload(array.array("B", b"".join(mine.q)))
            s_d = cuda.upload(array.array("B", b"".join(mine.s)))
            rq_d = cuda.alloc(M * H, fill=0xAB)
            rs_d = cuda.alloc(M * 16, fill=0xAB)
            rw_d = cuda.alloc(M * K * 4, fill=0xAB)
            ri_d = cuda.alloc(M * K * 8, fill=0xAB)
            din = nccl_ep.ncclEpDispatchInputs_t(
                tokens=desc(q_d, ncclFloat8e4m3, (mine.B, H)),
                scales=desc(s_d, ncclUint8, (mine.B, 16)),
                topk_weights=desc(w_d, ncclFloat32, (mine.B, K)),
            )
            dout = nccl_ep.ncclEpDispatchOutputs_t(
                tokens=desc(rq_d, ncclFloat8e4m3, (M, H)),
                scales=desc(rs_d, ncclUint8, (M, 16)),
                topk_weights=desc(rw_d, ncclFloat32, (M, K)),
                topk_idx=desc(ri_d, ncclInt64, (M, K)),
            )
            dcfg = nccl_ep.ncclEpDispatchConfig_v2_t(quant_recipe=nccl_ep.NCCL_EP_DISP_QUANT_FWD)
            lib.ncclEpDispatch(handle, din, dout, None, dcfg, stream)
            cuda.sync(stream)
            rq = cuda.download(rq_d, "B", M * H).tobytes()
            rs = cuda.download(rs_d, "B", M * 16).tobytes()
            ri = rows(cuda.download(ri_d, "q", M * K), M, K)
            rw = rows(cuda.download(rw_d, "f", M * K), M, K)
            for j, (r, t) in enumerate(kept):
                src = inputs[r]
                chk.expect(rq[j * H:(j + 1) * H] == src.q[t], "FWD: rank 0 row %d is not rank %d's token %d's bytes" % (j, r, t))
                chk.expect(rw[j] == src.w[t], "FWD: rank 0 row %d: weights %r, expected %r" % (j, rw[j], src.w[t]))
                chk.expect(rs[j * 16:(j + 1) * 16] == src.s[t], "FWD: rank 0 row %d's scales are not rank %d's token %d's" % (j, r, t))
                chk.expect(ri[j] == src.idx[t], "FWD: rank 0 row %d: ids %r, expected %r" % (j, ri[j], src.idx[t]))
        finally:
            lib.ncclEpHandleDestroy(handle)
    finally:
        lib.ncclEpGroupDestroy(group)
        cuda.free_all()
        lib.ncclCommDestroy(comm)
    print("rank %d: %d checks, %d failed" % (rank, chk.checks, chk.failures))
    return 1 if chk.failures else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=None, help="replay a run (default: a fresh seed)")
    ap.add_argument("--max-tokens", type=int, default=16, help="M: tokens per rank and rank 0's receive budget")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--local-experts", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--require-gpu", action="store_true", help="exit 2 instead of 0 when there is no GPU")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--uid-file", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        return rank_main(args)
    if args.ranks < 2:
        print("FAIL: --ranks must be at least 2 (one rank never receives more than it sends)")
        return 1
    if gpu_count() == 0:
        print("SKIPPED: no CUDA GPU (libcuda.so.1 missing or no device): the overflow test did not run")
        return 2 if args.require_gpu else 0
    if not nccl_ep.HAVE_NCCL_EP:
        print("FAIL: %s" % nccl_ep.NCCL_EP_LOAD_MESSAGE)
        return 1
    seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little")
    print("seed %d (replay with --seed %d); %d ranks on %d GPU(s)" % (seed, seed, args.ranks, gpu_count()))
    uid_file = "/tmp/epflow-overflow-uid-%d-%d" % (os.getpid(), seed)
    env = dict(os.environ, NCCL_MULTI_RANK_GPU_ENABLE="1", PYTHONUNBUFFERED="1")
    base = [sys.executable, os.path.abspath(__file__), "--ranks", str(args.ranks), "--seed", str(seed), "--uid-file", uid_file,
            "--max-tokens", str(args.max_tokens), "--hidden", str(args.hidden), "--top-k", str(args.top_k),
            "--local-experts", str(args.local_experts), "--timeout", str(args.timeout)]
    procs = [subprocess.Popen(base + ["--child", str(r)], env=env) for r in range(args.ranks)]
    failed = 0
    deadline = time.time() + args.timeout
    for r, p in enumerate(procs):
        try:
            rc = p.wait(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            print("FAIL: rank %d did not finish within %.0f s" % (r, args.timeout))
            for q in procs:
                q.kill()
            rc = 1
        failed += rc != 0
    try:
        os.remove(uid_file)
    except OSError:
        pass
    print("overflow (DROP): %d of %d ranks failed (seed %d)" % (failed, args.ranks, seed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

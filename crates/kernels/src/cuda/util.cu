// epflow utilities.

// Dequantizes `rows` FP8 rows (`hidden` e4m3 values, `hidden / 128` fp32 scales each) into BF16:
// out = bf16(e4m3_to_f32(q) * scale), as the CPU reference's identity experts do.
extern "C" __global__ void ep_dequant_fp8_rows(u64 q_ptr, u64 scales_ptr, u64 out_ptr, u64 rows, int hidden) {
    const unsigned char* q = reinterpret_cast<const unsigned char*>(q_ptr);
    const float* scales = reinterpret_cast<const float*>(scales_ptr);
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(out_ptr);
    const u64 total = rows * (u64)hidden;
    const int cols = hidden / 128;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / hidden;
        const int c = (int)(i % hidden);
        __half_raw h = __nv_cvt_fp8_to_halfraw((__nv_fp8_storage_t)q[i], __NV_E4M3);
        const float v = __half2float(*reinterpret_cast<__half*>(&h));
        out[i] = __float2bfloat16_rn(__fmul_rn(v, scales[r * cols + c / 128]));
    }
}

// Widens `n` int32 values into int64 (sign-extended: -1 stays -1): NCCL EP API v2's int32
// `topk_idx` read as the int64 routing epflow's kernels take.
extern "C" __global__ void ep_widen_i32(u64 in_ptr, u64 out_ptr, u64 n) {
    const int* in = reinterpret_cast<const int*>(in_ptr);
    long long* out = reinterpret_cast<long long*>(out_ptr);
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        out[i] = (long long)in[i];
    }
}

// Turns the local expert ids of `rows` x `k` received top-k entries (int32 when `wide` is 0,
// int64 otherwise) into global ones in place: every id >= 0 gains `offset` (the receiving rank
// times its local experts), -1 ("not routed here") stays. With `counts` (int32, one per source),
// row r is live only below counts[r / rows_per_source] within its source's block, and the other
// rows are left as they are: NCCL EP API v2's `recv_topk_idx_kind` GLOBAL on outputs written
// with local ids.
extern "C" __global__ void ep_globalize_expert_ids(u64 idx_ptr, int wide, u64 rows, int k, u64 counts,
                                                   u64 rows_per_source, long long offset) {
    const u64 total = rows * (u64)k;
    for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
        const u64 r = i / (u64)k;
        if (counts != 0 && (r % rows_per_source) >= (u64)reinterpret_cast<const int*>(counts)[r / rows_per_source]) {
            continue;
        }
        if (wide) {
            long long* v = reinterpret_cast<long long*>(idx_ptr) + i;
            if (*v >= 0) *v += offset;
        } else {
            int* v = reinterpret_cast<int*>(idx_ptr) + i;
            if (*v >= 0) *v += (int)offset;
        }
    }
}

// High-throughput expert-major layout (NCCL EP's HT EXPERT_MAJOR) from a flat dispatch's
// outputs: `idx` ([N x K] int64, the receiving rank's local expert per entry or -1). Block `e`
// (one per local expert) numbers the entries of expert e in entry order, from its zone's first
// slot `offsets[e]`: pos_of[i] = offsets[e] + (entries of e before i). Entries of no local
// expert keep the -1 the caller filled `pos_of` with.
extern "C" __global__ void ep_em_slots(u64 idx_ptr, int N, int K, u64 offsets_ptr, u64 pos_ptr) {
    __shared__ int warp_hits[32];
    const long long* idx = reinterpret_cast<const long long*>(idx_ptr);
    int* pos_of = reinterpret_cast<int*>(pos_ptr);
    const long long e = blockIdx.x;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    long long next = reinterpret_cast<const long long*>(offsets_ptr)[e];
    const long long total = (long long)N * K;
    for (long long start = 0; start < total; start += blockDim.x) {
        const long long i = start + threadIdx.x;
        const bool hit = i < total && idx[i] == e;
        const unsigned ballot = __ballot_sync(0xffffffffu, hit);
        if (lane == 0) warp_hits[warp] = __popc(ballot);
        __syncthreads();
        int before = 0, chunk = 0;
        for (int w = 0; w < warps; ++w) {
            if (w < warp) before += warp_hits[w];
            chunk += warp_hits[w];
        }
        if (hit) pos_of[i] = (int)(next + before + __popc(ballot & ((1u << lane) - 1u)));
        next += chunk;
        __syncthreads();
    }
}

// Copies each flat row n ([N x H] BF16 `tokens`) to the slot of every entry (n, k) numbered in
// `pos_of`, with that entry's weight (`w`, [N x K] fp32) into `out_w` (one per slot; none when
// `out_w_ptr` is 0, a backward dispatch's gradients): one block per row.
extern "C" __global__ void ep_em_scatter(u64 tokens_ptr, u64 w_ptr, u64 pos_ptr, int N, int K, int H, u64 out_ptr,
                                         u64 out_w_ptr) {
    const int* pos_of = reinterpret_cast<const int*>(pos_ptr);
    const bool vec = (H % 8) == 0;
    for (int n = blockIdx.x; n < N; n += gridDim.x) {
        for (int k = 0; k < K; ++k) {
            const int p = pos_of[(long long)n * K + k];
            if (p < 0) continue;
            if (threadIdx.x == 0 && out_w_ptr) {
                reinterpret_cast<float*>(out_w_ptr)[p] = reinterpret_cast<const float*>(w_ptr)[(long long)n * K + k];
            }
            if (vec) {
                const uint4* src = reinterpret_cast<const uint4*>(tokens_ptr + (u64)n * H * 2);
                uint4* dst = reinterpret_cast<uint4*>(out_ptr + (u64)p * H * 2);
                for (int j = threadIdx.x; j < H / 8; j += blockDim.x) dst[j] = src[j];
            } else {
                const unsigned short* src = reinterpret_cast<const unsigned short*>(tokens_ptr) + (u64)n * H;
                unsigned short* dst = reinterpret_cast<unsigned short*>(out_ptr) + (u64)p * H;
                for (int j = threadIdx.x; j < H; j += blockDim.x) dst[j] = src[j];
            }
        }
    }
}

// Zeroes the padding of every expert zone: slots [offsets[e] + counts[e], offsets[e] +
// padded[e]) of `out` ([S x H] BF16) and `out_w` ([S] fp32, unless 0), one block per local expert.
extern "C" __global__ void ep_em_pad(u64 out_ptr, u64 out_w_ptr, u64 offsets_ptr, u64 counts_ptr, u64 padded_ptr,
                                     int H) {
    const long long e = blockIdx.x;
    const long long off = reinterpret_cast<const long long*>(offsets_ptr)[e];
    const long long first = off + reinterpret_cast<const long long*>(counts_ptr)[e];
    const long long end = off + reinterpret_cast<const long long*>(padded_ptr)[e];
    for (long long s = first; s < end; ++s) {
        if (threadIdx.x == 0 && out_w_ptr) reinterpret_cast<float*>(out_w_ptr)[s] = 0.0f;
        unsigned short* row = reinterpret_cast<unsigned short*>(out_ptr) + (u64)s * H;
        for (int j = threadIdx.x; j < H; j += blockDim.x) row[j] = 0;
    }
}

// A backward combine's flat weight gradients from expert-major slots: out[n][k] = the gradient
// of slot pos_of[n][k] of `slot_w` ([S] fp32), 0 for an entry of no local expert.
extern "C" __global__ void ep_em_gather_weights(u64 slot_w_ptr, u64 pos_ptr, long long entries, u64 out_ptr) {
    const int* pos_of = reinterpret_cast<const int*>(pos_ptr);
    const float* slot_w = reinterpret_cast<const float*>(slot_w_ptr);
    float* out = reinterpret_cast<float*>(out_ptr);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < entries; i += (long long)gridDim.x * blockDim.x) {
        const int p = pos_of[i];
        out[i] = p >= 0 ? slot_w[p] : 0.0f;
    }
}

// The flat combine input back from expert-major slots: out[n] = bf16(sum over k ascending of the
// fp32 values of slot pos_of[n][k] of `y` ([S x H] BF16)), entries of no local expert skipped;
// one block per row.
extern "C" __global__ void ep_em_reduce(u64 y_ptr, u64 pos_ptr, int N, int K, int H, u64 out_ptr) {
    const int* pos_of = reinterpret_cast<const int*>(pos_ptr);
    const __nv_bfloat16* y = reinterpret_cast<const __nv_bfloat16*>(y_ptr);
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(out_ptr);
    for (int n = blockIdx.x; n < N; n += gridDim.x) {
        for (int j = threadIdx.x; j < H; j += blockDim.x) {
            float acc = 0.0f;
            for (int k = 0; k < K; ++k) {
                const int p = pos_of[(long long)n * K + k];
                if (p >= 0) acc += __bfloat162float(y[(u64)p * H + j]);
            }
            out[(u64)n * H + j] = __float2bfloat16_rn(acc);
        }
    }
}

// Holds its stream for `ns` nanoseconds of the global timer (one thread): a deliberately slow
// consumer for tests of stream-ordered buffer release.
extern "C" __global__ void ep_spin(u64 ns) {
    u64 start;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    u64 now = start;
    while (now - start < ns) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
}

// One warp's 4 KB of a probe copy: 16-byte vectors [base, base + 256) below `end`, 8 loads in
// flight per lane before their stores.
__device__ __forceinline__ void probe_copy_4k(char* d, const char* s, u64 base, u64 end, u64 lane) {
    int4 v[8];
#pragma unroll
    for (int u = 0; u < 8; u++) {
        const u64 i = base + 32 * u + lane;
        if (i < end) v[u] = ld_cg_int4(s + i * 16);
    }
#pragma unroll
    for (int u = 0; u < 8; u++) {
        const u64 i = base + 32 * u + lane;
        if (i < end) st_na_int4(d + i * 16, v[u]);
    }
}

// Copies `bytes` (a multiple of 16) from `src` to `dst` (local or a peer's, over NVLink) with
// SM loads and stores: each warp moves 4 KB at a time, 8 vectors in flight per lane, as the
// high-throughput kernels' sending warps do. A probe of the SM-store ceiling (`nvlink_ceiling
// --sms`), not part of any operation.
extern "C" __global__ void __launch_bounds__(512) ep_sm_copy(u64 dst, u64 src, u64 bytes) {
    const u64 n = bytes / 16;
    const u64 lane = threadIdx.x & 31;
    const u64 warps = (u64)gridDim.x * (blockDim.x >> 5);
    const char* s = reinterpret_cast<const char*>(src);
    char* d = reinterpret_cast<char*>(dst);
    for (u64 base = ((u64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5)) * 256; base < n; base += warps * 256) {
        probe_copy_4k(d, s, base, n, lane);
    }
}

// `ep_sm_copy` with the work balanced between the blocks: each warp takes the next 16 KB piece
// of the copy from the counter at `counter` (a u64, zero at the launch), asking for its next
// piece before it copies the current one, so that a block the memory system serves faster
// copies more. A probe of whether the SM-store ceiling is bound by uneven blocks
// (`nvlink_ceiling --balanced`), not part of any operation.
extern "C" __global__ void __launch_bounds__(512) ep_sm_copy_balanced(u64 dst, u64 src, u64 bytes, u64 counter) {
    const u64 n = bytes / 16, piece = 1024;
    const u64 lane = threadIdx.x & 31;
    unsigned long long* next = reinterpret_cast<unsigned long long*>(counter);
    const char* s = reinterpret_cast<const char*>(src);
    char* d = reinterpret_cast<char*>(dst);
    unsigned long long mine = 0;
    if (lane == 0) mine = atomicAdd(next, 1ull);
    mine = __shfl_sync(EP_FULL_MASK, mine, 0);
    while (mine * piece < n) {
        unsigned long long after = 0;
        if (lane == 0) after = atomicAdd(next, 1ull);
        const u64 end = min(n, (mine + 1) * piece);
        for (u64 base = mine * piece; base < end; base += 256) probe_copy_4k(d, s, base, end, lane);
        mine = __shfl_sync(EP_FULL_MASK, after, 0);
    }
}

// Copies `bytes` (a multiple of 16) from `src` to `dst` (local or a peer's) with the Tensor
// Memory Accelerator: thread 0 of each block moves the block's chunks (chunk k of the copy goes
// to block k % gridDim.x) global -> shared -> global with bulk asynchronous copies, through
// `stages` (2..=TMA_MAX_STAGES) buffers of `chunk` bytes (a multiple of 16) of dynamic shared
// memory, keeping stages - 1 loads ahead of its stores. A probe of what bulk copies reach with
// few SMs (`nvlink_ceiling --tma`), not part of any operation.
#define TMA_MAX_STAGES 32
__device__ __forceinline__ void tma_load(u32 smem, const char* src, u32 size, u32 bar) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(size) : "memory");
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(smem),
                 "l"(src), "r"(size), "r"(bar)
                 : "memory");
}
__device__ __forceinline__ void tma_wait(u32 bar, u32 parity) {
    u32 done = 0;
    while (!done) {
        asm volatile(
            "{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    }
}
__device__ __forceinline__ void tma_store(char* dst, u32 smem, u32 size) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst), "r"(smem), "r"(size) : "memory");
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}
extern "C" __global__ void ep_tma_copy(u64 dst, u64 src, u64 bytes, u32 chunk, u32 stages) {
    extern __shared__ __align__(128) unsigned char tma_buf[];
    __shared__ __align__(8) u64 bar[TMA_MAX_STAGES];
    if (threadIdx.x != 0 || stages < 2 || stages > TMA_MAX_STAGES) return;
    const u64 chunks = (bytes + chunk - 1) / chunk;
    const u64 mine = chunks > blockIdx.x ? (chunks - blockIdx.x + gridDim.x - 1) / gridDim.x : 0;
    const u32 buf0 = (u32)__cvta_generic_to_shared(tma_buf), bar0 = (u32)__cvta_generic_to_shared(bar);
    for (u32 s = 0; s < stages; s++) asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(bar0 + 8 * s) : "memory");
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
    const char* s_ = reinterpret_cast<const char*>(src);
    char* d_ = reinterpret_cast<char*>(dst);
    auto off = [&](u64 k) { return (blockIdx.x + k * gridDim.x) * (u64)chunk; };
    auto size = [&](u64 k) { return (u32)min((u64)chunk, bytes - off(k)); };
    const u64 ahead = stages - 1;
    for (u64 k = 0; k < min(ahead, mine); k++) tma_load(buf0 + (u32)(k % stages) * chunk, s_ + off(k), size(k), bar0 + 8 * (u32)(k % stages));
    for (u64 k = 0; k < mine; k++) {
        const u32 st = (u32)(k % stages);
        tma_wait(bar0 + 8 * st, (u32)((k / stages) & 1));
        tma_store(d_ + off(k), buf0 + st * chunk, size(k));
        const u64 nk = k + ahead;
        if (nk < mine) {
            if (k >= 1) asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");
            const u32 ns = (u32)(nk % stages);
            tma_load(buf0 + ns * chunk, s_ + off(nk), size(nk), bar0 + 8 * ns);
        }
    }
    asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

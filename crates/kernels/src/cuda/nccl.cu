// epflow over NCCL (nccl.rs): the kernels around NCCL's grouped send/recv for high-throughput
// operations, and the arrival check every NCCL operation ends with.
//
// Dispatch: `ep_nccl_ht_pack` lays the rows for each destination out contiguously, in the
// handle's send order (per destination, ascending token), with the destination's view of the
// weights and indices; NCCL then moves each destination's block straight into that rank's
// outputs. Combine: NCCL brings every copy back into a staging block in the same order, and
// `ep_nccl_ht_reduce` sums them per token in ascending destination rank, as the CPU reference.

struct NcclHtParams {
    u64 x;            // dispatch: [B x row_bytes] tokens (BF16, or FP8 e4m3)
    u64 x_scales;     // dispatch FP8: [B x H/128] fp32
    u64 weights;      // dispatch forward: [B x K] fp32
    u64 topk_idx;     // [B x K] int64 (the handle's copy)
    u64 send_list;    // the handle's send plan (ht.rs)
    u64 send_off;
    u64 copy_ord;
    u64 out;          // pack: staging rows; reduce: [B x H] BF16
    u64 out_scales;   // pack FP8: staging scales
    u64 out_weights;  // pack forward: staging weights [rows x K]; reduce backward: [B x K] fp32
    u64 out_idx;      // pack forward: staging indices [rows x K] int64
    u64 in;           // reduce: staging rows [rows x H] BF16
    u64 in_weights;   // reduce backward: staging weight gradients [rows x K] fp32
    u64 signals;      // this rank's signal page
    u64 status;       // this rank's status page (mapped host)
    u64 seq;
    int rank, num_ranks, hidden, top_k;
    int num_local, num_tokens, channels, tokens_per_channel;
    int fp8, backward, chan, set;
    int cancelled, total_send, row_bytes, pad;
    u64 stamp;        // what every rank must agree on (epflow_core::stamp), checked per source
};
// The Rust mirror (epflow-kernels params.rs) must agree byte for byte.
static_assert(sizeof(NcclHtParams) == 200, "NcclHtParams layout");

// The destination of staging row i: the last rank whose block starts at or before i.
__device__ __forceinline__ int dest_of_row(const int* send_off, int C, int R, int i) {
    int d = 0;
    for (int r = 1; r < R; r++) {
        if (send_off[r * (C + 1)] <= i) d = r;
    }
    return d;
}

// Writes this rank's arrival pair for the operation (NCCL sends it to every rank), then, unless
// cancelled, packs the rows: one warp per row.
extern "C" __global__ void __launch_bounds__(512) ep_nccl_ht_pack(NcclHtParams p) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        u64* a = arrival_at(reinterpret_cast<u64*>(p.signals), p.chan, p.set, p.rank);
        a[1] = p.stamp;
        a[0] = arrival_word(p.seq, p.cancelled != 0, p.stamp);
    }
    if (p.cancelled) return;
    const int lane = threadIdx.x & 31;
    const int warps = gridDim.x * (blockDim.x >> 5);
    const int gw = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    const int K = p.top_k, L = p.num_local, C = p.channels, H = p.hidden;
    const int* list = reinterpret_cast<const int*>(p.send_list);
    const int* off = reinterpret_cast<const int*>(p.send_off);
    const long long* idx = reinterpret_cast<const long long*>(p.topk_idx);
    for (int i = gw; i < p.total_send; i += warps) {
        const int t = list[i];
        warp_copy(reinterpret_cast<char*>(p.out) + (size_t)i * p.row_bytes,
                  reinterpret_cast<const char*>(p.x) + (size_t)t * p.row_bytes, (size_t)p.row_bytes, lane);
        if (p.fp8) {
            const int cols = H / 128;
            const float* src = reinterpret_cast<const float*>(p.x_scales) + (size_t)t * cols;
            float* dst = reinterpret_cast<float*>(p.out_scales) + (size_t)i * cols;
            for (int c = lane; c < cols; c += 32) dst[c] = src[c];
        }
        if (!p.backward && lane < K) {
            const int d = dest_of_row(off, C, p.num_ranks, i);
            const long long e = idx[(size_t)t * K + lane];
            const bool here = e >= 0 && (int)(e / L) == d;
            reinterpret_cast<float*>(p.out_weights)[(size_t)i * K + lane] =
                here ? reinterpret_cast<const float*>(p.weights)[(size_t)t * K + lane] : 0.f;
            reinterpret_cast<long long*>(p.out_idx)[(size_t)i * K + lane] = here ? (long long)(e % L) : -1ll;
        }
    }
}

// Checks the arrival pair every source sent for this operation (NCCL delivered them before this
// kernel runs) and publishes the cancellation and mismatch masks in the status page, as the
// NVLink receive kernels do. One block of 32 threads.
extern "C" __global__ void ep_nccl_arrivals(NcclHtParams p) {
    u64* sig = reinterpret_cast<u64*>(p.signals);
    u32 cancelled = 0u, mismatched = 0u;
    const int s = threadIdx.x;
    if (s < p.num_ranks) {
        const u64 w = arrival_at(sig, p.chan, p.set, s)[0];
        if (!arrival_is(w, p.seq)) {
            report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_ARRIVAL, s, p.seq);
        } else {
            const int verdict = arrival_verdict(w, p.stamp);
            if (verdict == EP_ARRIVED_CANCELLED) cancelled = 1u << s;
            if (verdict == EP_ARRIVED_MISMATCH) mismatched = 1u << s;
        }
    }
#pragma unroll
    for (int m = 16; m >= 1; m >>= 1) {
        cancelled |= __shfl_xor_sync(EP_FULL_MASK, cancelled, m);
        mismatched |= __shfl_xor_sync(EP_FULL_MASK, mismatched, m);
    }
    if (threadIdx.x == 0) {
        publish_outcome(reinterpret_cast<u64*>(p.status), sig, p.chan, p.set, p.seq, cancelled, mismatched);
    }
}

// out[t] = bf16(sum over the destinations d holding a copy of t, ascending, of in[row(t, d)]),
// in fp32; backward, the weight gradient of (t, k) is the one its expert's owner sent. Block b
// takes tokens b, b + gridDim.x, ...
extern "C" __global__ void __launch_bounds__(256) ep_nccl_ht_reduce(NcclHtParams p) {
    const int R = p.num_ranks, C = p.channels, H = p.hidden, K = p.top_k, L = p.num_local;
    const int* off = reinterpret_cast<const int*>(p.send_off);
    const int* ord = reinterpret_cast<const int*>(p.copy_ord);
    const __nv_bfloat16* in = reinterpret_cast<const __nv_bfloat16*>(p.in);
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(p.out);
    for (int t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
        const int ch = t / p.tokens_per_channel;
        int rows[EP_MAX_RANKS];
        for (int d = 0; d < R; d++) {
            const int o = ord[(size_t)t * R + d];
            rows[d] = o < 0 ? -1 : off[d * (C + 1) + ch] + o;
        }
        for (int c = threadIdx.x * 8; c < H; c += blockDim.x * 8) {
            float acc[8];
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = 0.f;
            for (int d = 0; d < R; d++) {
                if (rows[d] < 0) continue;
                int4 raw = ld_cg_int4(in + (size_t)rows[d] * H + c);
                const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[i] = __fadd_rn(acc[i], __bfloat162float(b[i]));
            }
            __nv_bfloat16 o[8];
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = __float2bfloat16_rn(acc[i]);
            *reinterpret_cast<int4*>(out + (size_t)t * H + c) = *reinterpret_cast<int4*>(o);
        }
        if (p.backward && (int)threadIdx.x < K) {
            const long long e = reinterpret_cast<const long long*>(p.topk_idx)[(size_t)t * K + threadIdx.x];
            float w = 0.f;
            if (e >= 0) {
                const int row = rows[(int)(e / L)];
                if (row >= 0) w = reinterpret_cast<const float*>(p.in_weights)[(size_t)row * K + threadIdx.x];
            }
            reinterpret_cast<float*>(p.out_weights)[(size_t)t * K + threadIdx.x] = w;
        }
    }
}

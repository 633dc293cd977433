// The MoE layer's own kernels (epflow-moe): seeded weights, the router's top-k, the SwiGLU
// activation over the dispatch's padded layout (reading the per-expert counts on the device),
// an element-wise BF16 add, and the gather and weighted reduce around grouped experts over a
// high-throughput dispatch's rows. The GEMMs are cuBLAS. Compiled with NVRTC after epflow's
// `common.cuh` (which includes cuda_bf16.h and defines u64).

// splitmix64's finaliser: the weights' counter-based generator (weights.rs draws the same).
__device__ __forceinline__ u64 moe_mix(u64 z) {
  z += 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// out[i] = bf16((u * 2 - 1) * scale), u = (mix(key + i * golden) >> 40) / 2^24, for i < n.
extern "C" __global__ void moe_fill_uniform(__nv_bfloat16* out, u64 n, u64 key, float scale) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    u64 h = moe_mix(key + i * 0x9e3779b97f4a7c15ULL);
    float u = (float)(h >> 40) * (1.0f / 16777216.0f);
    out[i] = __float2bfloat16_rn(__fmul_rn(__fsub_rn(__fmul_rn(u, 2.0f), 1.0f), scale));
  }
}

// The router's top-k, one warp per token: logits [B x E] FP32 -> topk_idx [B x K] int64 and
// topk_weights [B x K] FP32. Selection is on the logits (softmax and sigmoid are monotone):
// the K highest, ties to the lower expert id, highest first; NaN logits are never chosen (an
// entry with nothing left to choose is -1, weight 0). Weights: softmax (scoring 0):
// exp(l_k - l_0) / sum over the chosen; sigmoid (scoring 1): s_k / sum of the chosen s, times
// `scale`. E <= 2048, K <= 16.
extern "C" __global__ void moe_router_topk(const float* __restrict__ logits, int B, int E, int K, int scoring,
                                           float scale, long long* __restrict__ topk_idx,
                                           float* __restrict__ topk_weights) {
  const int lane = threadIdx.x & 31;
  const int token = (int)((blockIdx.x * (u64)blockDim.x + threadIdx.x) >> 5);
  if (token >= B) return;
  const float* row = logits + (size_t)token * E;
  u64 taken = 0;  // bit s: expert lane + 32 * s chosen
  float vals[16];
  int ids[16];
  for (int k = 0; k < K; ++k) {
    float best = -__int_as_float(0x7f800000);
    int best_i = 0x7fffffff;
    for (int j = lane, s = 0; j < E; j += 32, ++s) {
      if ((taken >> s) & 1ULL) continue;
      float v = row[j];
      if (v > best || (v == best && j < best_i)) { best = v; best_i = j; }
    }
    for (int off = 16; off > 0; off >>= 1) {
      float ov = __shfl_xor_sync(0xffffffffu, best, off);
      int oi = __shfl_xor_sync(0xffffffffu, best_i, off);
      if (ov > best || (ov == best && oi < best_i)) { best = ov; best_i = oi; }
    }
    if (best_i != 0x7fffffff && (best_i & 31) == lane) taken |= 1ULL << (best_i >> 5);
    vals[k] = best;
    ids[k] = best_i == 0x7fffffff ? -1 : best_i;
  }
  if (lane != 0) return;
  float w[16];
  float sum = 0.0f;
  for (int k = 0; k < K; ++k) {
    float s = 0.0f;
    if (ids[k] >= 0) s = scoring == 0 ? expf(vals[k] - vals[0]) : 1.0f / (1.0f + expf(-vals[k]));
    w[k] = s;
    sum += s;
  }
  const float mul = scoring == 0 ? 1.0f : scale;
  for (int k = 0; k < K; ++k) {
    topk_idx[(size_t)token * K + k] = ids[k];
    topk_weights[(size_t)token * K + k] = sum > 0.0f ? w[k] / sum * mul : 0.0f;
  }
}

// SwiGLU's activation: for row r of expert l (block l * C + r; rows at or past counts[l] are
// skipped when `counts` is given), act[row][j] = bf16(silu(g) * u) with g = gu[row][j],
// u = gu[row][F + j]. gu [L x C x 2F], act [L x C x F], BF16.
extern "C" __global__ void moe_swiglu(const __nv_bfloat16* __restrict__ gu, __nv_bfloat16* __restrict__ act,
                                      const int* __restrict__ counts, int C, int F) {
  const u64 row = blockIdx.x;
  if (counts != nullptr && (int)(row % C) >= counts[row / C]) return;
  const __nv_bfloat16* in = gu + row * 2 * F;
  __nv_bfloat16* out = act + row * F;
  for (int j = threadIdx.x; j < F; j += blockDim.x) {
    float g = __bfloat162float(in[j]);
    float u = __bfloat162float(in[F + j]);
    out[j] = __float2bfloat16_rn(__fmul_rn(__fdiv_rn(g, __fadd_rn(1.0f, expf(-g))), u));
  }
}

// out[i] = bf16(f32(a[i]) + f32(b[i])) for i < n (out may be a or b).
extern "C" __global__ void moe_add(const __nv_bfloat16* a, const __nv_bfloat16* b, __nv_bfloat16* out, u64 n) {
  for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
    out[i] = __float2bfloat16_rn(__fadd_rn(__bfloat162float(a[i]), __bfloat162float(b[i])));
  }
}

// ---- Grouped experts over a high-throughput dispatch's rows (prefill) ----
//
// A high-throughput dispatch delivers N rows (one per source token that has a local expert),
// with `idx` [N x K] (local expert, or -1) and `w` [N x K]. The experts run as one GEMM group per
// local expert over its rows gathered contiguously: expert e's rows sit at positions
// base(e) = counts[0] + ... + counts[e-1] on, in (row, k) order, so the layout is deterministic.

// One block per local expert: the position of each of its (row, k) entries. rows[p] is the
// received row at position p, pos_of[row * K + k] its position (written for local entries only).
// `cap` bounds the positions written (the scratch's rows).
extern "C" __global__ void moe_ht_slots(const long long* __restrict__ idx, int N, int K,
                                        const int* __restrict__ counts, int cap, int* __restrict__ rows,
                                        int* __restrict__ pos_of) {
  __shared__ int warp_hits[32];
  __shared__ int base;
  const int e = blockIdx.x;
  if (threadIdx.x == 0) {
    int s = 0;
    for (int j = 0; j < e; ++j) s += counts[j];
    base = s;
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
  int offset = base;
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
    if (hit) {
      const int p = offset + before + __popc(ballot & ((1u << lane) - 1u));
      if (p < cap) {
        rows[p] = (int)(i / K);
        pos_of[i] = p;
      }
    }
    offset += chunk;
    __syncthreads();
  }
}

// out[p] = tokens[rows[p]] for p < P (H BF16 values per row, H a multiple of 8).
extern "C" __global__ void moe_ht_gather(const __nv_bfloat16* __restrict__ tokens, const int* __restrict__ rows,
                                         int P, int H, __nv_bfloat16* __restrict__ out) {
  const int vecs = H / 8;
  for (int p = blockIdx.x; p < P; p += gridDim.x) {
    const uint4* src = reinterpret_cast<const uint4*>(tokens + (u64)rows[p] * H);
    uint4* dst = reinterpret_cast<uint4*>(out + (u64)p * H);
    for (int j = threadIdx.x; j < vecs; j += blockDim.x) dst[j] = src[j];
  }
}

// out[n] = bf16(fma chain over k ascending, local entries only, of w[n][k] * y[pos_of[n][k]]),
// the weighted sum of row n's local experts, as the combine of a low-latency layer computes it.
extern "C" __global__ void moe_ht_reduce(const __nv_bfloat16* __restrict__ y, const long long* __restrict__ idx,
                                         const float* __restrict__ w, const int* __restrict__ pos_of, int N, int K,
                                         int H, __nv_bfloat16* __restrict__ out) {
  for (int n = blockIdx.x; n < N; n += gridDim.x) {
    for (int j = threadIdx.x; j < H; j += blockDim.x) {
      float acc = 0.0f;
      for (int k = 0; k < K; ++k) {
        const long long i = (long long)n * K + k;
        if (idx[i] >= 0) acc = __fmaf_rn(w[i], __bfloat162float(y[(u64)pos_of[i] * H + j]), acc);
      }
      out[(u64)n * H + j] = __float2bfloat16_rn(acc);
    }
  }
}

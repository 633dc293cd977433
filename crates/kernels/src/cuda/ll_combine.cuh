// epflow low-latency kernels, part 5 of 7 (after ll_receive.cuh): combine, send and receive, BF16
// and NVFP4.

// E2M1 code of `x` (epflow_core::nvfp4::f32_to_e2m1): nearest, ties to the even code,
// saturating at 6 (NaN too), the sign kept.
__device__ __forceinline__ u32 f32_to_e2m1(float x) {
    const float a = fabsf(x);
    const u32 m = a <= 0.25f ? 0u
                  : a < 0.75f ? 1u
                  : a <= 1.25f ? 2u
                  : a < 1.75f ? 3u
                  : a <= 2.5f ? 4u
                  : a < 3.5f ? 5u
                  : a <= 5.0f ? 6u
                              : 7u;
    return m | (signbit(x) ? 8u : 0u);
}

// The value of E2M1 code `c` (its low 4 bits), built from its bits: 0, 0.5, then
// 2^(e - 1) (1 + m / 2) for codes 2..7 (e = code >> 1, m = code & 1).
__device__ __forceinline__ float e2m1_to_f32(u32 c) {
    const u32 m = c & 7u;
    const u32 exp = m == 0u ? 0u : m == 1u ? 126u : 126u + (m >> 1);
    const u32 mant = m >= 2u ? (m & 1u) << 22 : 0u;
    return __uint_as_float(((c & 8u) << 28) | (exp << 23) | mant);
}

__device__ __forceinline__ float e4m3_to_f32(u32 byte) {
    __nv_fp8_e4m3 v;
    v.__x = (__nv_fp8_storage_t)byte;
    return float(v);
}

// An NVFP4 combine's piece [c, c + width) of expert output row `row` (`src` its channel c) into
// the row's slot `dst` (epflow_core::nvfp4 has the arithmetic, step by step): a lane per block of
// 16 channels, its 8 bytes of codes and its block scale; piece 0's lane 0 also the row's global
// scale. A warp's call.
__device__ __forceinline__ void nvfp4_piece(const LlParams& p, char* dst, const __nv_bfloat16* src, int row, int c,
                                            int width, int lane) {
    const int H = p.hidden;
    const float g = __ldg(reinterpret_cast<const float*>(p.x_scales) + row);
    if (c == 0 && lane == 0) *reinterpret_cast<float4*>(dst) = make_float4(g, 0.f, 0.f, 0.f);
    for (int b = lane; b < width / 16; b += 32) {
        const int cb = c + 16 * b;
        const int4 lo = ld_cg_int4(src + 16 * b), hi = ld_cg_int4(src + 16 * b + 8);
        const __nv_bfloat16* v0 = reinterpret_cast<const __nv_bfloat16*>(&lo);
        const __nv_bfloat16* v1 = reinterpret_cast<const __nv_bfloat16*>(&hi);
        float x[16];
#pragma unroll
        for (int i = 0; i < 8; i++) {
            x[i] = __bfloat162float(v0[i]);
            x[i + 8] = __bfloat162float(v1[i]);
        }
        float amax = 0.f;
#pragma unroll
        for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(x[i]));
        const u32 sf = (u32)__nv_cvt_float_to_fp8(__fmul_rn(__fdiv_rn(amax, 6.0f), g), __NV_SATFINITE, __NV_E4M3);
        const float s = e4m3_to_f32(sf);
        const float enc = s == 0.f ? 0.f : __fdiv_rn(g, s);
        u32 w[2] = {0u, 0u};
#pragma unroll
        for (int i = 0; i < 16; i++) w[i / 8] |= f32_to_e2m1(__fmul_rn(x[i], enc)) << (4 * (i % 8));
        *reinterpret_cast<uint2*>(dst + 16 + cb / 2) = make_uint2(w[0], w[1]);
        dst[16 + H / 2 + cb / 16] = (char)sf;
    }
}

// Combine send, on the expert side: every received (source s, token t, k) row of the expert
// output goes back to s, at [t][k] of its receive region, split in `chunks` pieces. Warps are
// split over sources as in dispatch; a source's warps share out the entries of its return list
// (only rows that go back: the row map's -1 entries take no warp's turn, so no warp gets more
// than its share when the routing clusters). A source that asked for tagged rows (its count's
// EP_RET_TAGGED bit) gets them in its tagged area, and its arrival before them (`signal_now`);
// so does one that gets no rows (nothing to order).
//
// Rank-major, the row of source d's list entry j is d * M + j: the list holds one entry per row
// the dispatch received from d (its first local k), in the order of the rows it wrote for d (the
// return list's block and the copy tasks judge the slots alike; compacted messages: slot j is row
// d * M + j, and has its entry unless its header names no token below M, which only a broken
// sender writes, or it is tagged and never came, which fails the operation), so no row map is
// read (one dependent load less before each piece).
// NVFP4 (the `_nvfp4` kernels, `LlParams::nvfp4`): rows go back quantized (`nvfp4_piece`),
// always plain (a source that asked for tagged rows gets plain ones: the host launches its plain
// NVFP4 receive); no NCCL peers (the host refuses them).
template <bool NVFP4>
__device__ __forceinline__ void combine_send(const LlParams& p, const OpNum& n) {
    const int C = p.chunks;
    const int d = send_dest(p);
    const int K = p.top_k, H = p.hidden, M = p.max_tokens;
    const bool serves = d < p.num_ranks;
    const int* list = reinterpret_cast<const int*>(p.ret_list) + (size_t)(serves ? d : 0) * M * K;
    // The source's count and this warp's first entry load together (the entry's place does not
    // depend on the count; it is used only if the count covers it), then (expert-major) its row,
    // all before the credit wait (their latency overlaps it).
    const int j0 = send_j(p);
    const int raw_count = serves ? __ldcg(reinterpret_cast<const int*>(p.ret_count) + d) : 0;
    const int count = raw_count & ~EP_RET_TAGGED;
    const bool tagged = !NVFP4 && (raw_count & EP_RET_TAGGED) != 0;
    const int i_first = serves && j0 / C < M * K ? __ldcg(list + j0 / C) : 0;
    // So does the credit's first look (lane 0 of every warp that serves a destination: the count
    // decides only after it whether the warp sends).
    const u64 credit = (threadIdx.x & 31) == 0 ? credit_first_look(p, n, 1, d) : 0ull;
    SendRole role;
    if (!send_role(p, n, 1, (long long)count * C, &role)) return;
    const int lane = role.lane, dest = role.dest, j = role.j, wpd = role.wpd;
    const int* row_of = reinterpret_cast<const int*>(p.row_of) + (size_t)dest * M * K;
    const bool rm = p.rank_major != 0;
    const int row_first = j < count * C ? (rm ? dest * M + j / C : __ldcg(row_of + i_first)) : 0;
    role_wait_credit(p, n, 1, &role, credit);
    const bool early = tagged || (count == 0 && !p.masking && !via_nccl(p, dest));
    if (early && j == 0 && lane == 0 && !role.skip) signal_now(p, n, 1, dest);
    if (!p.cancelled && !role.skip) {
        const __nv_bfloat16* ex = reinterpret_cast<const __nv_bfloat16*>(p.expert_out);
        const bool nccl = via_nccl(p, dest);
        const int* pack = reinterpret_cast<const int*>(p.nccl_pack) + (size_t)dest * M * K;
        char* region = nccl ? reinterpret_cast<char*>(p.nccl_out) + (size_t)dest * p.nccl_dest_bytes
                            : reinterpret_cast<char*>(p.peer_recv[dest]) + (size_t)n.set * p.recv_set_bytes;
        const int width = H / C;
        for (int item = j; item < count * C; item += wpd) {
            const int i = item == j ? i_first : __ldcg(list + item / C), chunk = item % C;
            const int row = item == j ? row_first : rm ? dest * M + item / C : __ldcg(row_of + i);
            const int c = chunk * width;
            const __nv_bfloat16* src = ex + (size_t)row * H + c;
            if constexpr (NVFP4) {
                nvfp4_piece(p, region + (size_t)i * H * 2, src, row, c, width, lane);
                continue;
            }
            if (tagged) {
                const int slot = p.rank_major ? i / K * p.num_ranks + p.rank : i;
                char* dst = tagged_row(p, p.peer_recv[dest], n.set, slot) + (size_t)c * 4;
                warp_copy_tagged(dst, reinterpret_cast<const char*>(src), (size_t)width * 2, lane, op_tag(n.seq));
                continue;
            }
            char* dst = region + ((size_t)i * H + c) * 2;
            if (nccl) dst = region + ((size_t)__ldcg(pack + i) * H + c) * 2;
            warp_copy(dst, src, (size_t)width * 2, lane);
        }
    }
    if (!early) signal_sent(p, n, 1, dest, role.reporting, lane);
}

// An NVFP4 combine's sum (see `combine_rows`, of which it is the counterpart): for each block of
// 16 channels c = c0, c0 + step, ... < end of token t, the rows of `used` in ascending k, B rows'
// loads in flight, each dequantized (`f32(q) * (s / g)`) and summed with fma(w[k], x, acc).
template <int B>
__device__ __forceinline__ void combine_rows_nvfp4(const LlParams& p, int t, int c0, int step, int end, unsigned used,
                                                   const char* recv, __nv_bfloat16* out) {
    const int K = p.top_k, H = p.hidden;
    const float* w = reinterpret_cast<const float*>(p.weights);
    for (int c = c0; c < end; c += step) {
        float acc[16];
#pragma unroll
        for (int i = 0; i < 16; i++) acc[i] = 0.f;
        unsigned left = used;
        while (true) {
            uint2 q[B];
            float g[B], wk[B];
            u32 sf[B];
            unsigned slots = 0u;
#pragma unroll
            for (int j = 0; j < B; j++) {
                const int k = left ? __ffs(left) - 1 : -1;
                if (left) left &= left - 1u;
                q[j] = make_uint2(0u, 0u);
                g[j] = 0.f;
                sf[j] = 0u;
                wk[j] = 0.f;
                if (k < 0) continue;
                slots |= 1u << j;
                wk[j] = p.rank_major ? 1.f : w[(size_t)t * K + k];
                const char* row = recv + ((size_t)t * K + k) * H * 2;
                g[j] = __ldcg(reinterpret_cast<const float*>(row));
                q[j] = __ldcg(reinterpret_cast<const uint2*>(row + 16 + c / 2));
                sf[j] = (u32)__ldcg(reinterpret_cast<const unsigned char*>(row + 16 + H / 2 + c / 16));
            }
#pragma unroll
            for (int j = 0; j < B; j++) {
                if (!((slots >> j) & 1u)) continue;
                const float s = e4m3_to_f32(sf[j]);
                const float dec = (s == 0.f || g[j] == 0.f) ? 0.f : __fdiv_rn(s, g[j]);
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    const u32 code = ((i < 8 ? q[j].x : q[j].y) >> (4 * (i % 8))) & 15u;
                    acc[i] = fmaf(wk[j], __fmul_rn(e2m1_to_f32(code), dec), acc[i]);
                }
            }
            if (!left) break;
        }
        __nv_bfloat16 o[16];
#pragma unroll
        for (int i = 0; i < 16; i++) o[i] = __float2bfloat16_rn(acc[i]);
        *reinterpret_cast<int4*>(out + (size_t)t * H + c) = *reinterpret_cast<int4*>(o);
        *reinterpret_cast<int4*>(out + (size_t)t * H + c + 8) = *reinterpret_cast<int4*>(o + 8);
    }
}

// Combine complete, on the source side: out[t] = bf16(sum over valid k, ascending, of
// fma(w[t][k], x[t][k], acc)) in fp32, exactly as the CPU reference. Rank-major: the k that are
// their rank's first entry only, with weight 1 (fma(1, x, acc) = acc + x).
//
// Each thread sums G 8-channel groups of a piece at once, B rows' loads of each in flight before
// the first FMA (the loads are independent; the sum still runs in ascending k, as the reference
// does). G = 1, B = 8, except rank-major on at most 2 ranks (at most 2 rows a token): G = 2,
// B = 2, so half the threads cover a piece and twice the pieces are summed at once (at 128
// tokens on 132 blocks, one round instead of two; B = 4 would spill in the one-launch kernel).
template <int G, int B>
__device__ __forceinline__ void combine_rows(const LlParams& p, int t, int c0, int step, int end, unsigned used,
                                             const char* recv, __nv_bfloat16* out) {
    const int K = p.top_k, H = p.hidden;
    const int* pos_of = reinterpret_cast<const int*>(p.nccl_pos);
    const float* w = reinterpret_cast<const float*>(p.weights);
    for (int c = c0; c < end; c += step * G) {
        float acc[G][8];
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int i = 0; i < 8; i++) acc[g][i] = 0.f;
        }
        unsigned left = used;
        while (true) {
            int4 raw[G][B];
            float wk[B];
            unsigned slots = 0u;  // bit j: slot j holds a row
#pragma unroll
            for (int j = 0; j < B; j++) {
                const int k = left ? __ffs(left) - 1 : -1;
                if (left) left &= left - 1u;
                if (k >= 0) slots |= 1u << j;
                wk[j] = k < 0 ? 0.f : p.rank_major ? 1.f : w[(size_t)t * K + k];
#pragma unroll
                for (int g = 0; g < G; g++) {
                    raw[g][j] = make_int4(0, 0, 0, 0);
                    const int cg = c + g * step;
                    if (k >= 0 && cg < end) {
                        const int pos = p.nccl_pos ? pos_of[(size_t)t * K + k] : -1;
                        const char* row = pos >= 0 ? reinterpret_cast<const char*>(p.nccl_in) + (size_t)pos * H * 2
                                                   : recv + ((size_t)t * K + k) * H * 2;
                        raw[g][j] = ld_cg_int4(row + (size_t)cg * 2);
                    }
                }
            }
#pragma unroll
            for (int j = 0; j < B; j++) {
                if (!((slots >> j) & 1u)) continue;
#pragma unroll
                for (int g = 0; g < G; g++) {
                    const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw[g][j]);
#pragma unroll
                    for (int i = 0; i < 8; i++) acc[g][i] = fmaf(wk[j], __bfloat162float(b[i]), acc[g][i]);
                }
            }
            if (!left) break;
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            const int cg = c + g * step;
            if (cg >= end) continue;
            __nv_bfloat16 o[8];
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = __float2bfloat16_rn(acc[g][i]);
            *reinterpret_cast<int4*>(out + (size_t)t * H + cg) = *reinterpret_cast<int4*>(o);
        }
    }
}

// Tagged rows (see EP_TAG_TOKENS): for each 8-channel group c = c0, c0 + step, ... < end of
// token t, the rows of `used` (bit k: entry k's row; rank-major, each rank's first entry only;
// nibble k of `ranks`: entry k's rank) in ascending k, two rows' loads in flight, each group
// taken once its four tags match (nothing is cleared: see EP_TAG_TOKENS); summed exactly as
// `combine_rows` does and written when `write`. False when a row stops arriving (its source
// signalled, then never sent it): the error is reported.
__device__ bool combine_rows_tagged(const LlParams& p, const OpNum& n, int t, int c0, int step, int end, unsigned used,
                                    u64 ranks, bool write, __nv_bfloat16* out) {
    const u32 tag = op_tag(n.seq);
    const float* w = reinterpret_cast<const float*>(p.weights);
    u64 deadline = 0;
    for (int c = c0; c < end; c += step) {
        float acc[8];
#pragma unroll
        for (int i = 0; i < 8; i++) acc[i] = 0.f;
        for (unsigned left = used; left;) {
            char* at[2];
            int4 lo[2], hi[2];
            float wk[2];
            int src[2], rows = 0;
#pragma unroll
            for (int j = 0; j < 2; j++) {
                at[j] = nullptr;
                src[j] = 0;
                wk[j] = 0.f;
                if (!left) continue;
                const int k = __ffs(left) - 1;
                left &= left - 1u;
                src[j] = (int)((ranks >> (4 * k)) & 15ull);
                wk[j] = p.rank_major ? 1.f : w[(size_t)t * p.top_k + k];
                const int slot = p.rank_major ? t * p.num_ranks + src[j] : t * p.top_k + k;
                at[j] = tagged_row(p, p.own_recv, n.set, slot) + (size_t)c * 4;
                lo[j] = ld_volatile_int4(at[j]);
                hi[j] = ld_volatile_int4(at[j] + 16);
                rows = j + 1;
            }
#pragma unroll
            for (int j = 0; j < 2; j++) {
                if (j >= rows) continue;
                while ((u32)lo[j].y != tag || (u32)lo[j].w != tag || (u32)hi[j].y != tag || (u32)hi[j].w != tag) {
                    const u64 now = globaltimer_ns();
                    if (deadline == 0) deadline = now + p.timeout_ns;
                    if (now > deadline) {
                        report_lost(p, n, 1, src[j]);
                        return false;
                    }
                    lo[j] = ld_volatile_int4(at[j]);
                    hi[j] = ld_volatile_int4(at[j] + 16);
                }
                // A BF16 is the high half of its fp32: channel 2q in the low half of word q.
                const u32 v[4] = {(u32)lo[j].x, (u32)lo[j].z, (u32)hi[j].x, (u32)hi[j].z};
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    acc[2 * q] = fmaf(wk[j], __uint_as_float(v[q] << 16), acc[2 * q]);
                    acc[2 * q + 1] = fmaf(wk[j], __uint_as_float(v[q] & 0xffff0000u), acc[2 * q + 1]);
                }
            }
        }
        if (write) {
            __nv_bfloat16 o[8];
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = __float2bfloat16_rn(acc[i]);
            *reinterpret_cast<int4*>(out + (size_t)t * p.hidden + c) = *reinterpret_cast<int4*>(o);
        }
    }
    return true;
}

// TAGGED: the receive of a combine that takes tagged rows (`wants_tagged`; the host launches the
// `_tagged` kernels exactly then, epflow-kernels params.rs `LlParams::tagged_rows`). Its own
// instantiation, so the plain kernels keep their registers (the tagged loop in the same kernel
// made the one-launch combine spill 352 B and cost expert-major 128 tokens 7 us). NVFP4: the
// receive of an NVFP4 combine (`combine_rows_nvfp4`; its rows are never tagged), in 16-channel
// blocks.
template <bool TAGGED, bool NVFP4 = false>
__device__ __forceinline__ void combine_recv(const LlParams& p, const OpNum& n) {
    __shared__ u32 cancelled, mismatched, absent;
    __shared__ int timed_out;
    // Items (token t, piece `part` of C = recv_chunks): an item takes `tpi` threads, its piece's
    // 8-channel groups over G (groups a thread sums at once) rounded up to whole warps (at most
    // the block), so a block works on `ipb` items at once; item i goes to block (i / ipb) % grid.
    // Only the blocks with items take part (at least block 0): the others neither wait nor count
    // themselves done (at one token, most of the grid leaves here).
    const int C = p.recv_chunks;
    const int width = p.hidden / C;
    constexpr bool tagged = TAGGED;
    const bool pairs = p.rank_major && p.num_ranks <= 2 && !tagged;  // combine_rows<2, 2>
    const int G = pairs ? 2 : 1;
    const int per_thread = NVFP4 ? 16 : 8;  // channels a thread sums per group
    const int tpi = min((int)blockDim.x, ((width / per_thread + G - 1) / G + 31) / 32 * 32);
    const int ipb = (int)blockDim.x / tpi;
    const int items = p.num_tokens * C;
    const int blocks = max(1, min((int)gridDim.x, (items + ipb - 1) / ipb));
    if ((int)blockIdx.x >= blocks) return;
    if (!ll_wait_all_sources(p, n, 1, &cancelled, &mismatched, &timed_out, &absent)) return;
    publish_early(p, n, 1, cancelled, mismatched, absent);
    trace_at(p, 1, 2);
    const int K = p.top_k;
    const long long* idx = reinterpret_cast<const long long*>(p.topk_idx);
    const char* recv = reinterpret_cast<const char*>(p.own_recv) + (size_t)n.set * p.recv_set_bytes;
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(p.out);
    // Any cancelled or mismatched source (this rank's own cancellation included) leaves the
    // output unwritten: the operation has no result; so does this rank being masked. Entries on
    // absent (masked) ranks contribute zero, counted per token in `masked_out`. Tagged rows of
    // the other sources are still taken (a row that never comes is still reported).
    const bool clean = (cancelled | mismatched) == 0u && !((absent >> p.rank) & 1u);
    const u32 unsent = cancelled | mismatched;  // tagged: sources whose rows never come
    bool ok = true;  // false once a tagged row timed out (reported; the group is poisoned)
    if (clean || tagged) {
        const int sub = (int)threadIdx.x / tpi, tid = (int)threadIdx.x % tpi;
        for (int item = blockIdx.x * ipb + sub; sub < ipb && item < items; item += blocks * ipb) {
            const int t = item / C, part = item % C;
            // The entries whose rows arrive, once per token, a lane per entry (K <= 16; every warp
            // works them out, all lanes call): every valid k on a present rank, or in rank-major
            // only each rank's first; `lost`: the valid k on absent (masked) ranks. One load and a
            // 32-bit division per lane (a routed expert is below E), not K dependent loads.
            const int lane = threadIdx.x & 31;
            const int e = lane < K ? (int)idx[(size_t)t * K + lane] : -1;
            const int er = e >= 0 ? e / p.num_local : -1;
            if constexpr (TAGGED) {
                // No masking: every valid entry's row comes (rank-major: each rank's once, at its
                // first k) unless its source cancelled or mismatched.
                const bool comes = er >= 0 && !((unsent >> er) & 1u);
                unsigned used = __ballot_sync(EP_FULL_MASK, comes);
                if (p.rank_major) {
                    const unsigned same = __match_any_sync(EP_FULL_MASK, comes ? er : -1 - lane);
                    used = __ballot_sync(EP_FULL_MASK, comes && __ffs(same) - 1 == lane);
                }
                const u32 nib = comes ? (u32)er << (4 * (lane & 7)) : 0u;
                const u64 ranks = (u64)__reduce_or_sync(EP_FULL_MASK, lane < 8 ? nib : 0u) |
                                  ((u64)__reduce_or_sync(EP_FULL_MASK, lane >= 8 ? nib : 0u) << 32);
                const int c0 = part * width + tid * 8, end = (part + 1) * width;
                if (ok && !combine_rows_tagged(p, n, t, c0, tpi * 8, end, used, ranks, clean, out)) ok = false;
                continue;
            }
            const bool gone = er >= 0 && ((absent >> er) & 1u);
            const bool arrives = er >= 0 && !gone;
            unsigned used = __ballot_sync(EP_FULL_MASK, arrives);
            if (p.rank_major) {
                const unsigned same = __match_any_sync(EP_FULL_MASK, arrives ? er : -1 - lane);
                used = __ballot_sync(EP_FULL_MASK, arrives && __ffs(same) - 1 == lane);
            }
            const int lost = __popc(__ballot_sync(EP_FULL_MASK, gone));
            if (p.masked_out && part == 0 && tid == 0) reinterpret_cast<int*>(p.masked_out)[t] = lost;
            if constexpr (NVFP4) {
                combine_rows_nvfp4<4>(p, t, part * width + tid * 16, tpi * 16, (part + 1) * width, used, recv, out);
                continue;
            }
            const int c0 = part * width + tid * 8, end = (part + 1) * width;
            if (pairs) {
                combine_rows<2, 2>(p, t, c0, tpi * 8, end, used, recv, out);
            } else {
                combine_rows<1, 8>(p, t, c0, tpi * 8, end, used, recv, out);
            }
        }
    }
    trace_at(p, 1, 3);
    finish_receive(p, n, 1, cancelled, mismatched, absent, blocks);
}

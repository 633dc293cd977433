// epflow high-throughput kernels, part 3 of 5 (after ht_send.cuh): the receiving blocks of
// dispatch and combine.

// Direct dispatch, the receiving block of channel c at its start (threads < R): tells each
// source s where its rows of this channel go (null: into the ring), before the block waits for
// anything (the sources' starts, or its helpers' receivers), so that a source's first row waits
// for one signal, not a round trip: the stamp beside the addresses keeps a source that runs
// another operation from writing (a cancelled source writes nothing anyway).
__device__ __forceinline__ void ht_offer_outputs(const HtParams& p, int c) {
    const int R = p.num_ranks, C = p.channels, K = p.top_k;
    if ((int)threadIdx.x >= R || p.direct <= 0) return;
    const int s = threadIdx.x;
    const int cnt = s == p.rank ? 0 : reinterpret_cast<const int*>(p.recv_cnt)[s * C + c];
    if (cnt < p.direct) return;
    const bool direct_out = p.direct_mem != 0;
    const int cols = p.scale_cols;
    u64* slot = ht_direct(reinterpret_cast<u64*>(p.peer_signals[s]), p.chan, c, p.rank);
    const u64 row0 = (u64)reinterpret_cast<const int*>(p.recv_base)[s * C + c];
    const u32 tag = ht_slot_tag(p.seq);
    ht_put_tagged(slot, 0, direct_out ? p.out + row0 * (u64)p.row_bytes : 0, tag);
    ht_put_tagged(slot, 1, direct_out && p.fp8 ? p.out_scales + row0 * (u64)cols * 4 : 0, tag);
    ht_put_tagged(slot, 2, direct_out && !p.backward ? p.out_weights + row0 * (u64)K * 4 : 0, tag);
    ht_put_tagged(slot, 3, direct_out && !p.backward ? p.out_idx + row0 * (u64)K * 8 : 0, tag);
    ht_put_tagged(slot, 4, p.stamp, tag);
}

// Dispatch receiver of channel c (after `ht_offer_outputs` and `ht_help_direct`): copies ready
// items of every source into their output rows, up to `batch` per source per round, and returns
// ring space after each round.
__device__ void ht_dispatch_recv(const HtParams& p, int c) {
    __shared__ u32 cancelled, mismatched;
    __shared__ int failed;
    __shared__ u64 pos[EP_MAX_RANKS];
    __shared__ int left[EP_MAX_RANKS], take[EP_MAX_RANKS], base[EP_MAX_RANKS], done[EP_MAX_RANKS];
    __shared__ int round_items, any_left;
    __shared__ u32 direct;  // sources writing their rows straight into this rank's outputs
    const int R = p.num_ranks, C = p.channels, K = p.top_k;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64* sig = reinterpret_cast<u64*>(p.signals);
    const int cols = p.scale_cols;
    const bool direct_out = p.direct_mem != 0;
    if (!ht_wait_starts(p, &cancelled, &mismatched, &failed)) return;
    if (threadIdx.x == 0) direct = 0u;
    __syncthreads();
    if ((int)threadIdx.x < R) {
        const int s = threadIdx.x;
        const int cnt = s == p.rank ? 0 : reinterpret_cast<const int*>(p.recv_cnt)[s * C + c];
        pos[s] = *ht_cons(sig, p.chan, c, s, p.seq);
        *ht_cons(sig, p.chan, c, s, p.seq + 1) = pos[s] + (u64)cnt;
        left[s] = cnt;
        base[s] = reinterpret_cast<const int*>(p.recv_base)[s * C + c];
        done[s] = 0;
        // A direct source writes its rows itself: this block only waits for its subtails.
        if (p.direct > 0 && cnt >= p.direct && direct_out && !((cancelled >> s) & 1u)) atomicOr(&direct, 1u << s);
    }
    __syncthreads();
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    while (true) {
        if ((int)threadIdx.x < R) {
            const int s = threadIdx.x;
            int t = 0;
            if (left[s] > 0) {
                if ((cancelled >> s) & 1u) {
                    t = left[s];
                } else {
                    const u64 end = ht_ready_end(p, c, s);
                    const u64 at = pos[s] + (u64)done[s];
                    const u64 avail = end > at ? end - at : 0;
                    const u64 cap = (u64)((direct >> s) & 1u ? left[s] : min(left[s], p.batch));
                    t = (int)(avail < cap ? avail : cap);
                }
            }
            take[s] = t;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            int items = 0, rest = 0, first_missing = -1;
            for (int s = 0; s < R; s++) {
                items += take[s];
                rest += left[s];
                if (left[s] > 0 && take[s] == 0 && first_missing < 0) first_missing = s;
            }
            round_items = items;
            any_left = rest;
            if (items == 0 && rest > 0 && globaltimer_ns() > deadline) {
                report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_ARRIVAL, first_missing, p.seq);
                failed = 1;
            }
        }
        __syncthreads();
        if (failed || any_left == 0) break;
        if (round_items == 0) continue;
        if (!p.cancelled) {
            for (int q = warp; q < round_items; q += HT_WARPS) {
                int s = 0, k = q;
                while (k >= take[s]) {
                    k -= take[s];
                    s++;
                }
                if (((cancelled | direct) >> s) & 1u) continue;
                const u64 g = pos[s] + (u64)done[s] + (u64)k;
                const size_t row = (size_t)base[s] + done[s] + k;
                const char* slot = ht_slot(p.own_ring, p, c, s, g);
                warp_copy_n<8>(reinterpret_cast<char*>(p.out) + row * p.row_bytes, slot, p.row_bytes, lane);
                if (p.fp8) {
                    ht_copy_scales(reinterpret_cast<float*>(p.out_scales) + row * cols,
                                   reinterpret_cast<const float*>(slot + p.off_scales), cols, lane);
                }
                if (!p.backward && lane < K) {
                    reinterpret_cast<float*>(p.out_weights)[row * K + lane] =
                        __ldcg(reinterpret_cast<const float*>(slot + p.off_weights) + lane);
                    reinterpret_cast<long long*>(p.out_idx)[row * K + lane] =
                        __ldcg(reinterpret_cast<const int*>(slot + p.off_idx) + lane);
                }
            }
        }
        __syncthreads();
        if ((int)threadIdx.x < R && take[threadIdx.x] > 0) {
            const int s = threadIdx.x;
            done[s] += take[s];
            left[s] -= take[s];
            // The ring space read is given back with a release; a direct or cancelled source's
            // items took none (nothing of this operation was read from its ring), so a relaxed
            // store moves its head, without a system-scope fence as the kernel ends.
            u64* head = ht_head(reinterpret_cast<u64*>(p.peer_signals[s]), p.chan, c, p.rank);
            if (((cancelled | direct) >> s) & 1u) {
                st_relaxed_sys(head, pos[s] + (u64)done[s]);
            } else {
                st_release_sys(head, pos[s] + (u64)done[s]);
            }
        }
        __syncthreads();
    }
    ht_publish_mask(p, c, cancelled, mismatched);
}

// Sums token t's copies (ascending destination rank, fp32 from 0, rounded to BF16 once) over
// channels [c0, c1) of its row into `orow`. NR bounds the ranks and G is the number of 256-channel
// groups a lane loads before it adds any: NR * G loads of 16 bytes in flight per lane (16 for
// every NR, so the register cost is the same: 2 ranks keep 8 groups in flight, 8 ranks 2).
// This rank's copy is row `local_row0 + ord` of the expert output (`lrow` is that output at
// `local_row0`); a peer's is row `ord` at `pull[d]` in the peer's expert output (pull combine),
// or else its slot in this rank's ring (`pos`: the rings' first positions).
template <int NR, int G>
__device__ __forceinline__ void ht_combine_span(const HtParams& p, int c, int t, const u64* pos, const u64* pull,
                                                u32 cancelled, const __nv_bfloat16* lrow, __nv_bfloat16* orow,
                                                int c0, int c1, int lane) {
    const int R = p.num_ranks;
    const char* src[NR];
#pragma unroll
    for (int d = 0; d < NR; d++) {
        const int o = (d < R && !((cancelled >> d) & 1u)) ? reinterpret_cast<const int*>(p.copy_ord)[(size_t)t * R + d]
                                                          : -1;
        src[d] = o < 0          ? nullptr
                 : d == p.rank  ? reinterpret_cast<const char*>(lrow + (size_t)o * p.hidden)
                 : pull[d] != 0 ? reinterpret_cast<const char*>(pull[d]) + (size_t)o * p.hidden * 2
                                : ht_slot(p.own_ring, p, c, d, pos[d] + (u64)o);
    }
    for (int ch = c0 + lane * 8; ch < c1; ch += 256 * G) {
        int4 raw[G][NR];
#pragma unroll
        for (int g = 0; g < G; g++) {
#pragma unroll
            for (int d = 0; d < NR; d++) {
                if (src[d] != nullptr && ch + 256 * g < c1) raw[g][d] = ld_cg_int4(src[d] + (size_t)(ch + 256 * g) * 2);
            }
        }
#pragma unroll
        for (int g = 0; g < G; g++) {
            if (ch + 256 * g >= c1) continue;
            float acc[8];
#pragma unroll
            for (int i = 0; i < 8; i++) acc[i] = 0.f;
#pragma unroll
            for (int d = 0; d < NR; d++) {
                if (src[d] == nullptr) continue;
                const __nv_bfloat16* b = reinterpret_cast<const __nv_bfloat16*>(&raw[g][d]);
#pragma unroll
                for (int i = 0; i < 8; i++) acc[i] = __fadd_rn(acc[i], __bfloat162float(b[i]));
            }
            __nv_bfloat16 o[8];
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = __float2bfloat16_rn(acc[i]);
            *reinterpret_cast<int4*>(orow + ch + 256 * g) = *reinterpret_cast<int4*>(o);
        }
    }
}

// Tokens [tb, te) of channel c summed into the output by the block's warps (a quarter row per
// warp where H allows; `ht_combine_span`); backward also picks each k's weight gradient from the
// copy of the rank that owns expert k (`pull_w[d]`: a pulled peer's gradients, in place).
template <int NR, int G>
__device__ __forceinline__ void ht_combine_tokens(const HtParams& p, int c, int tb, int te, const u64* pos,
                                                  const u64* pull, const u64* pull_w, u32 cancelled, int local_row0) {
    const int R = p.num_ranks, K = p.top_k, H = p.hidden, L = p.num_local;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int* copy_ord = reinterpret_cast<const int*>(p.copy_ord);
    const __nv_bfloat16* lrow = reinterpret_cast<const __nv_bfloat16*>(p.x) + (size_t)local_row0 * H;
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(p.out);
    const int parts = (H % 32 == 0) ? 4 : 1;
    const int width = H / parts;
    for (int q = warp; q < (te - tb) * parts; q += HT_WARPS) {
        const int t = tb + q / parts, part = q % parts;
        const int c0 = part * width, c1 = c0 + width;
        ht_combine_span<NR, G>(p, c, t, pos, pull, cancelled, lrow, out + (size_t)t * H, c0, c1, lane);
        if (p.backward && part == 0 && lane < K) {
            const long long e = reinterpret_cast<const long long*>(p.topk_idx)[(size_t)t * K + lane];
            float w = 0.f;
            if (e >= 0) {
                const int d = (int)(e / L);
                const int o = copy_ord[(size_t)t * R + d];
                if (d == p.rank) {
                    w = reinterpret_cast<const float*>(p.weights)[((size_t)local_row0 + o) * K + lane];
                } else if (pull[d] != 0) {
                    w = __ldcg(reinterpret_cast<const float*>(pull_w[d]) + (size_t)o * K + lane);
                } else if (!((cancelled >> d) & 1u)) {
                    w = __ldcg(reinterpret_cast<const float*>(ht_slot(p.own_ring, p, c, d, pos[d] + (u64)o) +
                                                              p.off_weights) + lane);
                }
            }
            reinterpret_cast<float*>(p.out_weights)[(size_t)t * K + lane] = w;
        }
    }
}

// Combine receiver of channel c: for each batch of `batch` tokens, waits for their copies, then
// sums them (ascending destination rank) into the output. Pulled sources (`ht_direct`) need no
// wait: their rows are read in place, and their heads go out once, at the end. NR (at least the
// ranks) and G as in `ht_combine_span`.
template <int NR, int G>
__device__ void ht_combine_recv(const HtParams& p, int c) {
    __shared__ u32 cancelled, mismatched;
    __shared__ int failed, ring;
    __shared__ u64 pos[EP_MAX_RANKS], pull[EP_MAX_RANKS], pull_w[EP_MAX_RANKS];
    __shared__ int need[EP_MAX_RANKS], prev[EP_MAX_RANKS], total[EP_MAX_RANKS];
    if (!ht_wait_starts(p, &cancelled, &mismatched, &failed)) return;
    const int R = p.num_ranks, C = p.channels;
    u64* sig = reinterpret_cast<u64*>(p.signals);
    const int* send_off = reinterpret_cast<const int*>(p.send_off);
    const int* copy_ord = reinterpret_cast<const int*>(p.copy_ord);
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    if ((int)threadIdx.x < R) {
        const int d = threadIdx.x;
        const int n = d == p.rank ? 0 : send_off[d * (C + 1) + c + 1] - send_off[d * (C + 1) + c];
        total[d] = n;
        pos[d] = *ht_cons(sig, p.chan, c, d, p.seq);
        *ht_cons(sig, p.chan, c, d, p.seq + 1) = pos[d] + (u64)n;
        prev[d] = 0;
        pull[d] = pull_w[d] = 0;
        if (d != p.rank && p.direct > 0 && n >= p.direct && !p.cancelled && !((cancelled >> d) & 1u)) {
            // Where source d's rows are (null: the ring): it offers them at its start, in tagged
            // words with its stamp (a differing stamp is a stale slot: a source running another
            // operation was skipped above).
            const u64* slot = ht_direct(sig, p.chan, c, d);
            const u32 tag = ht_slot_tag(p.seq);
            u32 h[6];
            while (true) {
                bool all = true;
#pragma unroll
                for (int w = 0; w < 6; w++) all &= ht_get_tagged(slot, w, tag, &h[w]);
                if (all && (((u64)h[5] << 32) | h[4]) == p.stamp) break;
                if (globaltimer_ns() > deadline) {
                    report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_ARRIVAL, d, p.seq);
                    atomicExch(&failed, 1);
                    break;
                }
            }
            if (!failed) {
                pull[d] = ((u64)h[1] << 32) | h[0];
                pull_w[d] = ((u64)h[3] << 32) | h[2];
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int r = 0;
        for (int d = 0; d < R; d++) r += d != p.rank && total[d] > 0 && !((cancelled >> d) & 1u) && pull[d] == 0;
        ring = r;
    }
    __syncthreads();
    if (failed) return;
    const int local_row0 = reinterpret_cast<const int*>(p.recv_base)[p.rank * C + c];
    const int t_begin = min(c * p.tokens_per_channel, p.num_tokens);
    const int t_end = min(t_begin + p.tokens_per_channel, p.num_tokens);
    // Without a ring source, the channel's tokens are one batch.
    const int step = ring > 0 ? p.batch : max(t_end - t_begin, 1);
    for (int tb = t_begin; tb < t_end; tb += step) {
        const int te = min(tb + step, t_end);
        if ((int)threadIdx.x < R) {
            const int d = threadIdx.x;
            int n = prev[d];
            for (int t = te - 1; t >= tb; t--) {
                const int o = copy_ord[(size_t)t * R + d];
                if (o >= 0) {
                    n = o + 1;
                    break;
                }
            }
            need[d] = n;
            if (d != p.rank && n > prev[d] && !((cancelled >> d) & 1u) && pull[d] == 0) {
                while (ht_ready_end(p, c, d) < pos[d] + (u64)n) {
                    if (globaltimer_ns() > deadline) {
                        report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_ARRIVAL, d, p.seq);
                        atomicExch(&failed, 1);
                        break;
                    }
                }
            }
        }
        __syncthreads();
        if (failed) return;
        if (!p.cancelled) ht_combine_tokens<NR, G>(p, c, tb, te, pos, pull, pull_w, cancelled, local_row0);
        __syncthreads();
        if ((int)threadIdx.x < R) {
            const int d = threadIdx.x;
            if (need[d] > prev[d]) {
                prev[d] = need[d];
                if (d != p.rank && pull[d] == 0) {
                    st_release_sys(ht_head(reinterpret_cast<u64*>(p.peer_signals[d]), p.chan, c, p.rank),
                                   pos[d] + (u64)need[d]);
                }
            }
        }
    }
    if ((int)threadIdx.x < R && pull[threadIdx.x] != 0) {
        // Every row of a pulled source is read: its expert output may go.
        const int d = threadIdx.x;
        st_release_sys(ht_head(reinterpret_cast<u64*>(p.peer_signals[d]), p.chan, c, p.rank), pos[d] + (u64)total[d]);
    }
    ht_publish_mask(p, c, cancelled, mismatched);
}

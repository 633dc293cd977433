// epflow high-throughput dispatch and combine over NVLink, and the count exchange of handle
// creation.
//
// ## Channels and rings
//
// A kernel has 2 * C blocks: blocks 0..C send, blocks C..2C receive. Channel c of a rank covers
// its tokens [c * T, (c + 1) * T) (T = tokens_per_channel); a rank's rows for a destination, in
// ascending token order, therefore split into C consecutive runs, one per channel.
//
// Between every (source, destination) pair each channel has a ring of `depth` slots in the
// receiver's memory: ring (c, source) of the receiver. Items are numbered by their global
// position g (every item the pair ever exchanged on this channel, monotonic across operations);
// item g lives in slot g % depth. The W sending warps of a destination own the residues
// g % W: after writing item g, a warp publishes subtail[g % W] = g / W + 1 in the receiver's signal
// page (release, after a system fence), so items [pos, end) are ready where
// end = min over r of (r + subtail[r] * W). The receiver publishes head = items consumed in the
// sender's page; a sender writes item g only when g < head + depth.
//
// Dispatch: items are the copies (token, destination) of the channel, written into the output
// rows [recv_base[source][c], + recv_cnt[source][c]) of the receiver in order. Copies to this
// rank itself are written straight to the output by the sender warps.
// Direct dispatch (`direct` > 0: ranks of one process, whose peers' memory every rank
// addresses), for a (source, channel) pair of at least `direct` rows (both sides know the count
// from the handle): the receiving block of channel c first tells the source where its rows go
// (`ht_direct`: the addresses of its first output row, scales, weights and indices, then the
// operation number), and the source writes its rows there instead of into the ring: no ring space
// to wait for, and no copy out of the ring. Its warps still publish their final subtails, which
// is what the receiver waits for, and the receiver still returns the ring positions (head), so
// the rings' numbering goes on as if the items had passed through them. A receiver whose
// outputs peers may not reach (`direct_out` 0: caller memory, a buffer allocated for this
// operation) or that was cancelled publishes a null address: that source uses the ring.
// Combine (the reverse): the expert side sends those rows back; the token side's receiver walks
// its channel's tokens in order, summing each token's copies in ascending destination rank
// (fp32, from 0, rounded to BF16 once), copies on this rank read directly from the expert output.
//
// Cancellation and timeouts: at its start every kernel signals its arrival pair (chan, seq % 2)
// (`signal_arrival`: the stamp, then the arrival word) to every receiver; a cancelled sender writes no data and
// publishes its final subtails at once; receivers skip a cancelled source's data. Every wait has
// the op's deadline and reports through the status page.
//
// Mismatches: a receiver that finds a source's stamp different from its own (another handle,
// top-k or pass) skips that source's data, reports EP_ERR_MISMATCH and writes ABORT(chan)[seq % 2]
// [this rank] into the source's page, which makes the source's warps sending here stop waiting
// for ring space. The two ranks' ring positions then disagree: the host poisons the group.

#define HT_MAX_CHANNELS 128
#define HT_MAX_WARPS 16
#define HT_BLOCK 512
#define HT_WARPS (HT_BLOCK / 32)

struct HtParams {
    u64 x;            // dispatch: tokens [B x H] (BF16, or FP8 bytes); combine: expert outputs [N x H] BF16
    u64 x_scales;     // dispatch FP8: [B x H/128] fp32
    u64 weights;      // dispatch forward: [B x K] fp32; combine backward: weight gradients [N x K] fp32
    u64 topk_idx;     // [B x K] int64 (the handle's copy)
    u64 send_list;    // int32 tokens per destination, ascending (the handle's send plan)
    u64 send_off;     // int32 [R][C + 1]: absolute offsets into send_list per (destination, channel)
    u64 recv_base;    // int32 [R][C]: first received row of (source, channel)
    u64 recv_cnt;     // int32 [R][C]: rows received from (source, channel)
    u64 copy_ord;     // int32 [B][R]: index of token t among its channel's copies to rank d, or -1
    u64 out;          // dispatch: [N x H]; combine: [B x H] BF16
    u64 out_scales;   // dispatch FP8: [N x H/128] fp32
    u64 out_weights;  // dispatch forward: [N x K] fp32; combine backward: [B x K] fp32
    u64 out_idx;      // dispatch forward: [N x K] int64
    u64 own_ring;     // this rank's receive rings of this channel
    u64 signals;      // this rank's signal page
    u64 status;       // this rank's status page (mapped host)
    u64 peer_ring[EP_MAX_RANKS];
    u64 peer_signals[EP_MAX_RANKS];
    u64 seq, timeout_ns;
    u64 slot_bytes;   // bytes of one ring slot
    u64 ring_bytes;   // bytes of one ring (depth * slot_bytes)
    int rank, num_ranks, hidden, top_k;
    int num_local, num_tokens, channels, depth;
    int warps_per_dest, fp8, backward, cancelled;
    int chan, row_bytes, off_scales, off_weights;
    int off_idx, tokens_per_channel, batch, items_per_fence;
    u64 stamp;        // what every rank must agree on (epflow_core::stamp), checked per source
    int direct;       // dispatch: 0, or the rows of a (source, channel) pair from which the group writes them
                      // into the receiver's outputs (the same on every rank)
    int direct_out;   // dispatch with `direct`: this rank's outputs take direct writes in this operation
};
// The Rust mirror (epflow-kernels params.rs) must agree byte for byte.
static_assert(sizeof(HtParams) == 384, "HtParams layout");

// Ring counters, after the arrays of the signal page: subtail [chan][c][peer][residue] (written by
// the peer), head [chan][c][peer] (written by the peer), and this rank's own positions,
// prod [chan][c][peer][seq parity] and cons [chan][c][peer][seq parity] (operation s reads parity
// s % 2 and writes the other).
#define HT_SUBTAIL_WORDS (2 * HT_MAX_CHANNELS * EP_MAX_RANKS * HT_MAX_WARPS)
#define HT_PEER_WORDS (2 * HT_MAX_CHANNELS * EP_MAX_RANKS)

__device__ __forceinline__ u64* ht_subtail(u64* page, int chan, int c, int peer, int r) {
    return page + EP_SIG_ARRAY_WORDS + (((size_t)chan * HT_MAX_CHANNELS + c) * EP_MAX_RANKS + peer) * HT_MAX_WARPS + r;
}
__device__ __forceinline__ u64* ht_head(u64* page, int chan, int c, int peer) {
    return page + EP_SIG_ARRAY_WORDS + HT_SUBTAIL_WORDS + ((size_t)chan * HT_MAX_CHANNELS + c) * EP_MAX_RANKS + peer;
}
__device__ __forceinline__ u64* ht_prod(u64* page, int chan, int c, int peer, u64 parity) {
    return page + EP_SIG_ARRAY_WORDS + HT_SUBTAIL_WORDS + HT_PEER_WORDS +
           (((size_t)chan * HT_MAX_CHANNELS + c) * EP_MAX_RANKS + peer) * 2 + (parity & 1);
}
__device__ __forceinline__ u64* ht_cons(u64* page, int chan, int c, int peer, u64 parity) {
    return page + EP_SIG_ARRAY_WORDS + HT_SUBTAIL_WORDS + 3 * HT_PEER_WORDS +
           (((size_t)chan * HT_MAX_CHANNELS + c) * EP_MAX_RANKS + peer) * 2 + (parity & 1);
}

// Direct dispatch: what the receiver of channel c tells source `peer` (in the source's page):
// [0] the operation number + 1 (released last), [1] the address of the source's first output row
// (0: use the ring), [2] of its first row's scales, [3] weights, [4] indices.
#define HT_DIRECT_SLOT 8
__device__ __forceinline__ u64* ht_direct(u64* page, int c, int peer) {
    return page + EP_SIG_ARRAY_WORDS + HT_SUBTAIL_WORDS + 5 * HT_PEER_WORDS +
           ((size_t)c * EP_MAX_RANKS + peer) * HT_DIRECT_SLOT;
}

__device__ __forceinline__ char* ht_slot(u64 ring_base, const HtParams& p, int c, int src, u64 g) {
    return reinterpret_cast<char*>(ring_base) + ((size_t)c * p.num_ranks + src) * p.ring_bytes +
           (size_t)(g % (u64)p.depth) * p.slot_bytes;
}

// End of the ready prefix of ring (c, src): min over residues r of r + subtail[r] * W.
__device__ __forceinline__ u64 ht_ready_end(const HtParams& p, int c, int src) {
    u64* sig = reinterpret_cast<u64*>(p.signals);
    u64 end = ~0ull;
    for (int r = 0; r < p.warps_per_dest; r++) {
        const u64 e = (u64)r + ld_acquire_sys(ht_subtail(sig, p.chan, c, src, r)) * (u64)p.warps_per_dest;
        end = e < end ? e : end;
    }
    return end;
}

// Copies `bytes` (a multiple of 16) with one warp, 8 vectors in flight per lane, the rest one
// vector at a time: the combine's send (the tail batch of `warp_copy_n`, which the dispatch
// uses, costs the combine kernel ~150 bytes of spills at its 128 registers).
__device__ __forceinline__ void warp_copy8(void* dst, const void* src, size_t bytes, int lane) {
    const size_t n = bytes / 16;
    const char* s = reinterpret_cast<const char*>(src);
    char* d = reinterpret_cast<char*>(dst);
    size_t i = lane;
    for (; i + 224 < n; i += 256) {
        int4 v[8];
#pragma unroll
        for (int u = 0; u < 8; u++) v[u] = ld_cg_int4(s + (i + 32 * u) * 16);
#pragma unroll
        for (int u = 0; u < 8; u++) st_na_int4(d + (i + 32 * u) * 16, v[u]);
    }
    for (; i < n; i += 32) st_na_int4(d + i * 16, ld_cg_int4(s + i * 16));
}

// Signals the start of this operation to every receiver (block 0, warp 0).
__device__ __forceinline__ void ht_signal_start(const HtParams& p) {
    const int lane = threadIdx.x & 31;
    if (blockIdx.x == 0 && threadIdx.x < 32 && lane < p.num_ranks) {
        u64* peer = reinterpret_cast<u64*>(p.peer_signals[lane]);
        signal_arrival(peer, p.chan, (int)(p.seq & 1), p.rank, p.seq, p.cancelled != 0, p.stamp);
    }
}

// Receiver blocks: waits for every source's start signal; false on timeout. Sets the masks of
// cancelled sources and of mismatched ones; `*skip` is both (whose data this block ignores).
__device__ bool ht_wait_starts(const HtParams& p, u32* skip, u32* mismatched, int* failed) {
    if (threadIdx.x == 0) {
        *skip = 0u;
        *mismatched = 0u;
        *failed = 0;
    }
    __syncthreads();
    if ((int)threadIdx.x < p.num_ranks) {
        const int s = threadIdx.x;
        u64* sig = reinterpret_cast<u64*>(p.signals);
        const u64 deadline = globaltimer_ns() + p.timeout_ns;
        switch (wait_arrival(sig, p.chan, (int)(p.seq & 1), s, p.seq, p.stamp, deadline)) {
            case EP_ARRIVAL_TIMEOUT:
                report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_ARRIVAL, s, p.seq);
                atomicExch(failed, 1);
                break;
            case EP_ARRIVED_CANCELLED:
                atomicOr(skip, 1u << s);
                break;
            case EP_ARRIVED_MISMATCH:
                atomicOr(skip, 1u << s);
                atomicOr(mismatched, 1u << s);
                report_error(reinterpret_cast<u64*>(p.status), EP_ERR_MISMATCH, s, p.seq);
                st_release_sys(sig_at(reinterpret_cast<u64*>(p.peer_signals[s]), EP_SIG_ABORT(p.chan), (int)(p.seq & 1),
                                      p.rank),
                               p.seq + 1);
                break;
            default:
                break;
        }
    }
    __syncthreads();
    return *failed == 0;
}

// Publishes the cancellation and mismatch masks of this operation (first receiving block).
__device__ __forceinline__ void ht_publish_mask(const HtParams& p, int c, u32 skip, u32 mismatched) {
    if (c == 0 && threadIdx.x == 0) {
        publish_outcome(reinterpret_cast<u64*>(p.status), reinterpret_cast<u64*>(p.signals), p.chan, (int)(p.seq & 1),
                        p.seq, skip & ~mismatched, mismatched);
    }
}

// The weights and local expert indices a dispatched copy of token t carries to `dest`.
__device__ __forceinline__ void ht_copy_meta(const HtParams& p, int t, int dest, int lane, float* w_out, int* idx32,
                                             long long* idx64) {
    if (lane < p.top_k) {
        const long long e = reinterpret_cast<const long long*>(p.topk_idx)[(size_t)t * p.top_k + lane];
        const bool here = e >= 0 && (int)(e / p.num_local) == dest;
        const float w = here ? reinterpret_cast<const float*>(p.weights)[(size_t)t * p.top_k + lane] : 0.f;
        const int le = here ? (int)(e % p.num_local) : -1;
        w_out[lane] = w;
        if (idx32) idx32[lane] = le;
        if (idx64) idx64[lane] = le;
    }
}

// FP8 scales of a row: H / 128 floats; 16 bytes per lane when the row's scales are whole
// 16-byte vectors at 16-byte addresses (every row's are when H is a multiple of 512).
__device__ __forceinline__ void ht_copy_scales(float* dst, const float* src, int cols, int lane) {
    if (cols % 4 == 0 && ((reinterpret_cast<size_t>(dst) | reinterpret_cast<size_t>(src)) & 15) == 0) {
        for (int i = lane; i < cols / 4; i += 32) st_na_int4(dst + 4 * i, ld_cg_int4(src + 4 * i));
    } else {
        for (int i = lane; i < cols; i += 32) dst[i] = __ldcg(src + i);
    }
}

// The role of sending warp `warp`: its destination and its index j among that destination's
// warps (-1: idle). A dispatch's first S warps copy this rank's own rows (S = 16 - W (R - 1),
// the warps the W per remote destination leave); a combine has no own-copy warps (the receiver
// reads those rows in place). Then W warps per remote destination, in ascending rank order; the
// rest idle. W is the layout's per kernel (layout.rs `dispatch_send_warps`,
// `combine_send_warps`).
struct HtSendRole {
    int dest, j, warps;
};
__device__ __forceinline__ HtSendRole ht_send_role(const HtParams& p, int warp) {
    const int W = p.warps_per_dest, R = p.num_ranks;
    const int own = R == 1 ? HT_WARPS : p.chan == 0 ? HT_WARPS - W * (R - 1) : 0;
    if (warp < own) return {p.rank, warp, own};
    const int q = (warp - own) / W;
    if (q >= R - 1) return {-1, -1, 0};
    return {q < p.rank ? q : q + 1, (warp - own) % W, W};
}

// Direct dispatch, one sending warp of destination `dest` (see the top of the file): waits for
// the receiver's addresses, writes the warp's rows i = j, j + W, ... of `list` (`n` rows, the
// first at ring position `pos0`) there, then publishes the warp's final subtail. False, having
// written nothing, when the receiver asked for the ring instead.
__device__ bool ht_send_direct(const HtParams& p, int c, int dest, int j, int W, int n, u64 pos0, const int* list) {
    const int lane = threadIdx.x & 31;
    u64* sig = reinterpret_cast<u64*>(p.signals);
    const u64* slot = ht_direct(sig, c, dest);
    u64 addr[4] = {0, 0, 0, 0};
    int fail = 0;
    if (lane == 0) {
        const u64* abort = sig_at(sig, EP_SIG_ABORT(p.chan), (int)(p.seq & 1), dest);
        const u64 deadline = globaltimer_ns() + p.timeout_ns;
        while (ld_acquire_sys(slot) != p.seq + 1) {
            if (ld_acquire_sys(abort) == p.seq + 1) {
                fail = 1;  // the receiver skips this rank's rows (a mismatch it reported)
                break;
            }
            if (globaltimer_ns() > deadline) {
                report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_RING, dest, p.seq);
                fail = 1;
                break;
            }
        }
#pragma unroll
        for (int u = 0; u < 4; u++) addr[u] = fail ? 0 : ld_acquire_sys(slot + 1 + u);
    }
    if (__shfl_sync(EP_FULL_MASK, fail, 0)) return true;
#pragma unroll
    for (int u = 0; u < 4; u++) addr[u] = __shfl_sync(EP_FULL_MASK, addr[u], 0);
    if (addr[0] == 0) return false;
    const int cols = p.hidden / 128, K = p.top_k;
    for (int i = j; i < n; i += W) {
        const int t = list[i];
        warp_copy_n<8>(reinterpret_cast<char*>(addr[0]) + (size_t)i * p.row_bytes,
                       reinterpret_cast<const char*>(p.x) + (size_t)t * p.row_bytes, p.row_bytes, lane);
        if (p.fp8) {
            ht_copy_scales(reinterpret_cast<float*>(addr[1]) + (size_t)i * cols,
                           reinterpret_cast<const float*>(p.x_scales) + (size_t)t * cols, cols, lane);
        }
        if (!p.backward) {
            ht_copy_meta(p, t, dest, lane, reinterpret_cast<float*>(addr[2]) + (size_t)i * K, nullptr,
                         reinterpret_cast<long long*>(addr[3]) + (size_t)i * K);
        }
    }
    __threadfence_system();
    __syncwarp();
    if (lane == 0) {
        // Every item of residue r below the end counts as written (the cancelled sender's rule).
        const u64 r = (pos0 + (u64)j) % (u64)W, end = pos0 + (u64)n;
        st_release_sys(ht_subtail(reinterpret_cast<u64*>(p.peer_signals[dest]), p.chan, c, p.rank, (int)r),
                       (end + (u64)W - 1 - r) / (u64)W);
    }
    return true;
}

// One sending warp: the items of its destination `dest` with op-local index i = j, j + W, ...
// DISPATCH: the dispatch kernel's (p.chan == 0), a compile-time choice, so that neither kernel
// carries the other's copy loop in its registers.
template <bool DISPATCH>
__device__ void ht_send(const HtParams& p, int c) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int R = p.num_ranks, C = p.channels;
    const HtSendRole role = ht_send_role(p, warp);
    const int dest = role.dest, j = role.j, W = role.warps;
    if (dest < 0 || dest >= R) return;
    u64* sig = reinterpret_cast<u64*>(p.signals);
    const u64 pos0 = *ht_prod(sig, p.chan, c, dest, p.seq);
    const int* send_off = reinterpret_cast<const int*>(p.send_off);
    const int n = DISPATCH ? send_off[dest * (C + 1) + c + 1] - send_off[dest * (C + 1) + c]
                              : reinterpret_cast<const int*>(p.recv_cnt)[dest * C + c];
    if (j == 0 && lane == 0) *ht_prod(sig, p.chan, c, dest, p.seq + 1) = pos0 + (u64)n;
    const int* list = reinterpret_cast<const int*>(p.send_list) + (DISPATCH ? send_off[dest * (C + 1) + c] : 0);
    const int cols = p.hidden / 128;

    if (dest == p.rank) {
        // Dispatch to this rank: straight into the output rows. Combine: the receiver reads them.
        if (!DISPATCH || p.cancelled) return;
        const int row0 = reinterpret_cast<const int*>(p.recv_base)[p.rank * C + c];
        for (int i = j; i < n; i += W) {
            const int t = list[i];
            const size_t row = (size_t)row0 + i;
            warp_copy_n<8>(reinterpret_cast<char*>(p.out) + row * p.row_bytes,
                           reinterpret_cast<const char*>(p.x) + (size_t)t * p.row_bytes, p.row_bytes, lane);
            if (p.fp8) {
                ht_copy_scales(reinterpret_cast<float*>(p.out_scales) + row * cols,
                               reinterpret_cast<const float*>(p.x_scales) + (size_t)t * cols, cols, lane);
            }
            if (!p.backward) {
                ht_copy_meta(p, t, dest, lane, reinterpret_cast<float*>(p.out_weights) + row * p.top_k, nullptr,
                             reinterpret_cast<long long*>(p.out_idx) + row * p.top_k);
            }
        }
        return;
    }

    u64* peer_sig = reinterpret_cast<u64*>(p.peer_signals[dest]);
    if (p.cancelled) {
        // No data: the final subtail of this warp's residue, at once.
        const u64 r = (pos0 + (u64)j) % (u64)W;
        const u64 end = pos0 + (u64)n;
        if (lane == 0) st_release_sys(ht_subtail(peer_sig, p.chan, c, p.rank, (int)r), (end + (u64)W - 1 - r) / (u64)W);
        return;
    }
    if (DISPATCH && p.direct > 0 && n >= p.direct && ht_send_direct(p, c, dest, j, W, n, pos0, list)) return;
    const u64* head = ht_head(sig, p.chan, c, dest);
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    const int K = p.top_k, U = p.items_per_fence;
    // Groups of U items (i0, i0 + W, ...): written back to back, then one fence and one subtail.
    for (int i0 = j; i0 < n; i0 += W * U) {
        const int last = min(i0 + (U - 1) * W, i0 + (n - 1 - i0) / W * W);
        const u64 g_last = pos0 + (u64)last;
        int fail = 0;
        if (lane == 0) {
            const u64* abort = sig_at(sig, EP_SIG_ABORT(p.chan), (int)(p.seq & 1), dest);
            while (ld_acquire_sys(head) + (u64)p.depth <= g_last) {
                if (ld_acquire_sys(abort) == p.seq + 1) {
                    fail = 1;  // the receiver skips this rank's rows (a mismatch it reported)
                    break;
                }
                if (globaltimer_ns() > deadline) {
                    report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_RING, dest, p.seq);
                    fail = 1;
                    break;
                }
            }
        }
        if (__shfl_sync(EP_FULL_MASK, fail, 0)) return;
        for (int i = i0; i <= last; i += W) {
        const u64 g = pos0 + (u64)i;
        char* slot = ht_slot(p.peer_ring[dest], p, c, p.rank, g);
        if (DISPATCH) {
            const int t = list[i];
            warp_copy_n<8>(slot, reinterpret_cast<const char*>(p.x) + (size_t)t * p.row_bytes, p.row_bytes, lane);
            if (p.fp8) {
                ht_copy_scales(reinterpret_cast<float*>(slot + p.off_scales),
                               reinterpret_cast<const float*>(p.x_scales) + (size_t)t * cols, cols, lane);
            }
            if (!p.backward) {
                ht_copy_meta(p, t, dest, lane, reinterpret_cast<float*>(slot + p.off_weights),
                             reinterpret_cast<int*>(slot + p.off_idx), nullptr);
            }
        } else {
            const size_t row = (size_t)reinterpret_cast<const int*>(p.recv_base)[dest * C + c] + i;
            warp_copy8(slot, reinterpret_cast<const char*>(p.x) + row * p.row_bytes, p.row_bytes, lane);
            if (p.backward && lane < K) {
                reinterpret_cast<float*>(slot + p.off_weights)[lane] =
                    reinterpret_cast<const float*>(p.weights)[row * K + lane];
            }
        }
        }
        __threadfence_system();
        __syncwarp();
        if (lane == 0) {
            st_release_sys(ht_subtail(peer_sig, p.chan, c, p.rank, (int)(g_last % (u64)W)), g_last / (u64)W + 1);
        }
    }
}

// Dispatch receiver of channel c: copies ready items of every source into their output rows,
// up to `batch` per source per round, and returns ring space after each round.
__device__ void ht_dispatch_recv(const HtParams& p, int c) {
    __shared__ u32 cancelled, mismatched;
    __shared__ int failed;
    __shared__ u64 pos[EP_MAX_RANKS];
    __shared__ int left[EP_MAX_RANKS], take[EP_MAX_RANKS], base[EP_MAX_RANKS], done[EP_MAX_RANKS];
    __shared__ int round_items, any_left;
    __shared__ u32 direct;  // sources writing their rows straight into this rank's outputs
    if (!ht_wait_starts(p, &cancelled, &mismatched, &failed)) return;
    const int R = p.num_ranks, C = p.channels, K = p.top_k;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64* sig = reinterpret_cast<u64*>(p.signals);
    const int cols = p.hidden / 128;
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
        if (p.direct > 0 && cnt >= p.direct && !((cancelled >> s) & 1u)) {
            // Where source s's rows of this channel go (null: into the ring). With a direct
            // source, this block only waits for its subtails.
            const bool d = p.direct_out != 0;
            u64* slot = ht_direct(reinterpret_cast<u64*>(p.peer_signals[s]), c, p.rank);
            const u64 row0 = (u64)base[s];
            slot[1] = d ? p.out + row0 * (u64)p.row_bytes : 0;
            slot[2] = d && p.fp8 ? p.out_scales + row0 * (u64)cols * 4 : 0;
            slot[3] = d && !p.backward ? p.out_weights + row0 * (u64)K * 4 : 0;
            slot[4] = d && !p.backward ? p.out_idx + row0 * (u64)K * 8 : 0;
            st_release_sys(slot, p.seq + 1);
            if (d) atomicOr(&direct, 1u << s);
        }
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
            st_release_sys(ht_head(reinterpret_cast<u64*>(p.peer_signals[s]), p.chan, c, p.rank), pos[s] + (u64)done[s]);
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
// `local_row0`); a peer's is its slot in this rank's ring.
template <int NR, int G>
__device__ __forceinline__ void ht_combine_span(const HtParams& p, int c, int t, const u64* pos, u32 cancelled,
                                                const __nv_bfloat16* lrow, __nv_bfloat16* orow, int c0, int c1,
                                                int lane) {
    const int R = p.num_ranks;
    const char* src[NR];
#pragma unroll
    for (int d = 0; d < NR; d++) {
        const int o = (d < R && !((cancelled >> d) & 1u)) ? reinterpret_cast<const int*>(p.copy_ord)[(size_t)t * R + d]
                                                          : -1;
        src[d] = o < 0 ? nullptr
                 : d == p.rank ? reinterpret_cast<const char*>(lrow + (size_t)o * p.hidden)
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

// Combine receiver of channel c: for each batch of `batch` tokens, waits for their copies, then
// sums them (ascending destination rank) into the output; backward also picks each k's weight
// gradient from the copy of the rank that owns expert k. NR (at least the ranks) and G as in
// `ht_combine_span`.
template <int NR, int G>
__device__ void ht_combine_recv(const HtParams& p, int c) {
    __shared__ u32 cancelled, mismatched;
    __shared__ int failed;
    __shared__ u64 pos[EP_MAX_RANKS];
    __shared__ int need[EP_MAX_RANKS], prev[EP_MAX_RANKS];
    if (!ht_wait_starts(p, &cancelled, &mismatched, &failed)) return;
    const int R = p.num_ranks, C = p.channels, K = p.top_k, H = p.hidden, L = p.num_local;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    u64* sig = reinterpret_cast<u64*>(p.signals);
    const int* send_off = reinterpret_cast<const int*>(p.send_off);
    const int* copy_ord = reinterpret_cast<const int*>(p.copy_ord);
    if ((int)threadIdx.x < R) {
        const int d = threadIdx.x;
        const int total = d == p.rank ? 0 : send_off[d * (C + 1) + c + 1] - send_off[d * (C + 1) + c];
        pos[d] = *ht_cons(sig, p.chan, c, d, p.seq);
        *ht_cons(sig, p.chan, c, d, p.seq + 1) = pos[d] + (u64)total;
        prev[d] = 0;
    }
    __syncthreads();
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    const int local_row0 = reinterpret_cast<const int*>(p.recv_base)[p.rank * C + c];
    const __nv_bfloat16* local = reinterpret_cast<const __nv_bfloat16*>(p.x);
    __nv_bfloat16* out = reinterpret_cast<__nv_bfloat16*>(p.out);
    const int parts = (H % 32 == 0) ? 4 : 1;
    const int width = H / parts;
    const int t_begin = min(c * p.tokens_per_channel, p.num_tokens);
    const int t_end = min(t_begin + p.tokens_per_channel, p.num_tokens);
    for (int tb = t_begin; tb < t_end; tb += p.batch) {
        const int te = min(tb + p.batch, t_end);
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
            if (d != p.rank && n > prev[d] && !((cancelled >> d) & 1u)) {
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
        if (!p.cancelled) {
            for (int q = warp; q < (te - tb) * parts; q += HT_WARPS) {
                const int t = tb + q / parts, part = q % parts;
                const __nv_bfloat16* lrow = local + (size_t)local_row0 * H;
                __nv_bfloat16* orow = out + (size_t)t * H;
                const int c0 = part * width, c1 = c0 + width;
                ht_combine_span<NR, G>(p, c, t, pos, cancelled, lrow, orow, c0, c1, lane);
                if (p.backward && part == 0 && lane < K) {
                    const long long e = reinterpret_cast<const long long*>(p.topk_idx)[(size_t)t * K + lane];
                    float w = 0.f;
                    if (e >= 0) {
                        const int d = (int)(e / L);
                        const int o = copy_ord[(size_t)t * R + d];
                        if (d == p.rank) {
                            w = reinterpret_cast<const float*>(p.weights)[((size_t)local_row0 + o) * K + lane];
                        } else if (!((cancelled >> d) & 1u)) {
                            w = __ldcg(reinterpret_cast<const float*>(ht_slot(p.own_ring, p, c, d, pos[d] + (u64)o) +
                                                                      p.off_weights) + lane);
                        }
                    }
                    reinterpret_cast<float*>(p.out_weights)[(size_t)t * K + lane] = w;
                }
            }
        }
        __syncthreads();
        if ((int)threadIdx.x < R) {
            const int d = threadIdx.x;
            if (need[d] > prev[d]) {
                prev[d] = need[d];
                if (d != p.rank) {
                    st_release_sys(ht_head(reinterpret_cast<u64*>(p.peer_signals[d]), p.chan, c, p.rank),
                                   pos[d] + (u64)need[d]);
                }
            }
        }
    }
    ht_publish_mask(p, c, cancelled, mismatched);
}

// High-throughput dispatch (forward or backward), one launch: blocks [0, C) send, [C, 2C) receive.
extern "C" __global__ void __launch_bounds__(HT_BLOCK) ep_ht_dispatch_kernel(HtParams p) {
    ht_signal_start(p);
    if ((int)blockIdx.x < p.channels) {
        ht_send<true>(p, blockIdx.x);
    } else {
        ht_dispatch_recv(p, blockIdx.x - p.channels);
    }
}

// High-throughput combine (forward or backward), one launch: blocks [0, C) send, [C, 2C) receive.
// One kernel per bound on the ranks, so that the receiver's loads in flight fill the registers
// the smaller bound leaves (the host picks the smallest that covers the group).
template <int NR, int G>
__device__ __forceinline__ void ht_combine(const HtParams& p) {
    ht_signal_start(p);
    if ((int)blockIdx.x < p.channels) {
        ht_send<false>(p, blockIdx.x);
    } else {
        ht_combine_recv<NR, G>(p, blockIdx.x - p.channels);
    }
}
// Up to 8 ranks (EP_MAX_RANKS).
extern "C" __global__ void __launch_bounds__(HT_BLOCK) ep_ht_combine_kernel(HtParams p) {
    ht_combine<EP_MAX_RANKS, 2>(p);
}
// Up to 4 ranks.
extern "C" __global__ void __launch_bounds__(HT_BLOCK) ep_ht_combine_kernel_4ranks(HtParams p) {
    ht_combine<4, 4>(p);
}
// Up to 2 ranks.
extern "C" __global__ void __launch_bounds__(HT_BLOCK) ep_ht_combine_kernel_2ranks(HtParams p) {
    ht_combine<2, 8>(p);
}

struct ExchangeParams {
    u64 msgs;        // int32 [R][words] (mapped host): this rank's message to each rank
    u64 out;         // int32 [R][words] (mapped host): the message of each source
    u64 own;         // this rank's exchange region
    u64 signals;     // this rank's signal page
    u64 status;      // this rank's status page
    u64 peer_region[EP_MAX_RANKS];
    u64 peer_signals[EP_MAX_RANKS];
    u64 seq, timeout_ns;
    int rank, num_ranks, words, cancelled;
    u64 stamp;       // what every rank must agree on (the top-k), checked per source
};
static_assert(sizeof(ExchangeParams) == 208, "ExchangeParams layout");

// The count exchange of high-throughput handle creation (channel 2), one block: writes this
// rank's message into every rank's region [seq % 2][rank], signals, waits for every source, and
// copies the received messages to mapped host memory. Two region sets are enough: a rank can only
// start exchange s + 2 after every rank has started exchange s + 1, i.e. finished exchange s.
extern "C" __global__ void __launch_bounds__(256) ep_ht_exchange(ExchangeParams p) {
    __shared__ u32 cancelled, mismatched;
    const int R = p.num_ranks, set = (int)(p.seq & 1);
    const size_t set_words = (size_t)R * p.words;
    const int* msgs = reinterpret_cast<const int*>(p.msgs);
    if (!p.cancelled) {
        for (int i = threadIdx.x; i < R * p.words; i += blockDim.x) {
            const int d = i / p.words, w = i % p.words;
            reinterpret_cast<int*>(p.peer_region[d])[set * set_words + (size_t)p.rank * p.words + w] = msgs[i];
        }
    }
    __threadfence_system();
    __syncthreads();
    if ((int)threadIdx.x < R) {
        u64* peer = reinterpret_cast<u64*>(p.peer_signals[threadIdx.x]);
        signal_arrival(peer, 2, set, p.rank, p.seq, p.cancelled != 0, p.stamp);
    }
    __shared__ int timed_out;
    if (!wait_all_sources(reinterpret_cast<u64*>(p.signals), reinterpret_cast<u64*>(p.status), R, 2, set, p.seq,
                          p.stamp, p.timeout_ns, &cancelled, &mismatched, &timed_out)) {
        return;
    }
    const int* own = reinterpret_cast<const int*>(p.own) + set * set_words;
    volatile int* out = reinterpret_cast<volatile int*>(p.out);
    for (int i = threadIdx.x; i < R * p.words; i += blockDim.x) out[i] = __ldcg(own + i);
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
        publish_outcome(reinterpret_cast<u64*>(p.status), reinterpret_cast<u64*>(p.signals), 2, set, p.seq, cancelled,
                        mismatched);
    }
}

// ## Handles built on the device
//
// Over NVLink a high-throughput handle is built on the handle stream with no host copy of
// `topk_idx` or of the plan: the host zeroes the scratch (one memset), then
// - `ep_ht_plan_mark` (a thread per token) validates each row, copies it into the handle, marks
//   the destinations it reaches (a bit per rank) and counts the selections per expert;
// - `ep_ht_plan` runs R + 1 blocks: block d < R scans the marks for destination d (each thread a
//   run of consecutive tokens, one block-wide scan), writes d's part of the send plan, and
//   sends d the exchange message (rows per channel, then selections per local expert of d) with
//   the arrival pair of exchange `seq`; block R waits for every source's message and builds the
//   receive layout. Every block is resident (R + 1 <= 9 blocks), so block R may wait.
// The send plan is strided: d's tokens start at send_list[d * B], so no block needs another's
// count. What the host needs (the first invalid entry, N, rows per local expert) is written to
// mapped host memory. The message format is the count exchange's (`ep_ht_exchange`).
//
// A handle may be used before the host has seen it built (stream-ordered creation): operations
// on it are enqueued behind these kernels. So a failed creation (an invalid routing anywhere,
// a cancellation, a mismatch, a timeout) leaves an empty plan behind, which moves nothing and
// advances no ring: block R waits for the send blocks to finish (`done`, a scratch word) and
// writes zero rows to and from every rank over whatever they wrote. Success is the word
// result[4] = seq + 1, written last (the host zeroes it before the launch).

#define HT_PLAN_BLOCK 1024
#define HT_PLAN_WARPS (HT_PLAN_BLOCK / 32)
#define HT_MARK_BLOCK 256
#define HT_MARK_HIST 4096  // experts counted in shared memory first (more: straight to global)

struct HtPlanParams {
    u64 topk_in;     // the caller's topk_idx [B x K] int64
    u64 topk;        // the handle's copy [B x K] int64
    u64 send_list;   // int32 [R][B]: destination d's tokens, ascending, from d * B
    u64 send_off;    // int32 [R][C + 1]: absolute offsets into send_list
    u64 recv_base;   // int32 [R][C]
    u64 recv_cnt;    // int32 [R][C]
    u64 copy_ord;    // int32 [B][R]
    u64 counts;      // int32 [L]: rows received per local expert
    u64 scratch;     // int32 [E + 2], zeroed by the host: selections per expert, then
                     // 0x7fffffff - (first invalid entry t * K + k), or 0 if none, then the
                     // send blocks done
    u64 hits;        // uint8 [B]: bit d = token t reaches rank d
    u64 result;      // int64 [5 + L] (mapped host): first invalid entry t * K + k (or -1), its
                     // value, the earlier k it repeats (or -1), N, seq + 1 once built, then the
                     // rows per local expert
    u64 own;         // this rank's exchange region
    u64 signals;     // this rank's signal page
    u64 status;      // this rank's status page (mapped host)
    u64 peer_region[EP_MAX_RANKS];
    u64 peer_signals[EP_MAX_RANKS];
    u64 seq, timeout_ns;
    u64 stamp;       // what every rank must agree on (the top-k)
    int rank, num_ranks, num_tokens, top_k;
    int num_experts, num_local, channels, tokens_per_channel;
    int words, cancelled;
};
static_assert(sizeof(HtPlanParams) == 304, "HtPlanParams layout");

// A thread per token: validation, the handle's copy of the row, the ranks it reaches, and the
// selections per expert (up to its first invalid entry).
extern "C" __global__ void __launch_bounds__(HT_MARK_BLOCK) ep_ht_plan_mark(HtPlanParams p) {
    __shared__ int hist[HT_MARK_HIST];
    if (p.cancelled) return;
    const int K = p.top_k, E = p.num_experts, L = p.num_local;
    const bool shared_hist = E <= HT_MARK_HIST;
    int* counts = reinterpret_cast<int*>(p.scratch);
    if (shared_hist) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    }
    __syncthreads();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < p.num_tokens) {
        // Every load of the row in flight at once (unrolled), then the copy.
        long long row[EP_MAX_TOPK];
        const long long* in = reinterpret_cast<const long long*>(p.topk_in) + (size_t)t * K;
        long long* copy = reinterpret_cast<long long*>(p.topk) + (size_t)t * K;
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; ++k) row[k] = k < K ? in[k] : -1;
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; ++k) {
            if (k < K) copy[k] = row[k];
        }
        const int k_bad = topk_first_invalid(row, K, E);
        if (k_bad < K) atomicMax(counts + E, 0x7fffffff - (t * K + k_bad));
        unsigned mask = 0;
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; ++k) {
            const long long e = row[k];
            if (k >= k_bad || e < 0) continue;
            mask |= 1u << (int)(e / L);
            atomicAdd(shared_hist ? hist + e : counts + e, 1);
        }
        reinterpret_cast<unsigned char*>(p.hits)[t] = (unsigned char)mask;
    }
    __syncthreads();
    if (shared_hist) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) {
            if (hist[e]) atomicAdd(counts + e, hist[e]);
        }
    }
}

// Exclusive prefix sum of `v` over the block (HT_PLAN_BLOCK threads); `*total` gets the sum.
__device__ __forceinline__ int plan_block_scan(int v, int* warp_sums, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    int x = v;
    for (int o = 1; o < 32; o <<= 1) {
        const int y = __shfl_up_sync(EP_FULL_MASK, x, o);
        if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        int w = warp_sums[lane];
        for (int o = 1; o < 32; o <<= 1) {
            const int y = __shfl_up_sync(EP_FULL_MASK, w, o);
            if (lane >= o) w += y;
        }
        warp_sums[lane] = w;  // inclusive
    }
    __syncthreads();
    const int before = (warp == 0 ? 0 : warp_sums[warp - 1]) + x - v;
    *total = warp_sums[HT_PLAN_WARPS - 1];
    return before;
}

// Block d < R: destination d's send plan and message. Each thread takes a run of consecutive
// tokens, so one block-wide scan orders all of them.
__device__ __forceinline__ void plan_send(const HtPlanParams& p, int d, bool cancelled) {
    __shared__ int warp_sums[32];
    __shared__ int chan_start[HT_MAX_CHANNELS + 1];
    const int R = p.num_ranks, B = p.num_tokens, C = p.channels, T = p.tokens_per_channel;
    const int set = (int)(p.seq & 1);
    if (!cancelled) {
        const unsigned char* hits = reinterpret_cast<const unsigned char*>(p.hits);
        int* list = reinterpret_cast<int*>(p.send_list) + (size_t)d * B;
        int* copy_ord = reinterpret_cast<int*>(p.copy_ord);
        // Passes of HT_PLAN_BLOCK x 16 tokens: warp w takes 512 consecutive tokens, lane j the
        // tokens j, j + 32, ... of them, so every load and store of a warp is contiguous; the
        // order within the warp comes from one ballot per 32 tokens.
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const u32 below = (1u << lane) - 1u;
        int running = 0;
        for (int base = 0; base < B; base += HT_PLAN_BLOCK * 16) {
            const int w0 = base + warp * 512;
            u32 ballots[16];
            int warp_count = 0;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int t = w0 + 32 * i + lane;
                const bool hit = t < B && ((hits[t] >> d) & 1);
                ballots[i] = __ballot_sync(EP_FULL_MASK, hit);
                warp_count += __popc(ballots[i]);
            }
            int total;
            const int before = plan_block_scan(lane == 0 ? warp_count : 0, warp_sums, &total);
            const int first = running + __shfl_sync(EP_FULL_MASK, before, 0);
            // The list, and each channel's first position (channel c starts at token c * T).
            int acc = first;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int t = w0 + 32 * i + lane;
                const int pos = acc + __popc(ballots[i] & below);
                if (t < B && t % T == 0) chan_start[t / T] = pos;
                if ((ballots[i] >> lane) & 1u) list[pos] = t;
                acc += __popc(ballots[i]);
            }
            __syncthreads();
            acc = first;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int t = w0 + 32 * i + lane;
                const int pos = acc + __popc(ballots[i] & below);
                if (t < B) copy_ord[(size_t)t * R + d] = (ballots[i] >> lane) & 1u ? pos - chan_start[t / T] : -1;
                acc += __popc(ballots[i]);
            }
            running += total;
            __syncthreads();  // warp_sums of the next pass
        }
        for (int c = threadIdx.x; c <= C; c += blockDim.x) {
            if (c == C || c * T >= B) chan_start[c] = running;
        }
        __syncthreads();
        int* send_off = reinterpret_cast<int*>(p.send_off) + d * (C + 1);
        for (int c = threadIdx.x; c <= C; c += blockDim.x) send_off[c] = d * B + chan_start[c];
        // The message to d: rows per channel, then selections per local expert of d.
        const int* counts = reinterpret_cast<const int*>(p.scratch) + (size_t)d * p.num_local;
        int* msg = reinterpret_cast<int*>(p.peer_region[d]) + (size_t)set * R * p.words + (size_t)p.rank * p.words;
        for (int w = threadIdx.x; w < p.words; w += blockDim.x) {
            msg[w] = w < C ? chan_start[w + 1] - chan_start[w] : counts[w - C];
        }
    }
    // The block's writes, then one system fence and the release (cumulative through the
    // barrier), rather than a fence per thread.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        signal_arrival(reinterpret_cast<u64*>(p.peer_signals[d]), 2, set, p.rank, p.seq, cancelled, p.stamp);
        // Done with the plan's arrays (block R may overwrite them with an empty plan).
        atomicAdd(reinterpret_cast<int*>(p.scratch) + p.num_experts + 1, 1);
    }
}

// Block R, after a failed exchange: once every send block is done with the arrays, an empty
// plan over them (nothing to or from any rank, no routed entry), so operations enqueued on the
// handle move nothing.
__device__ __forceinline__ void plan_empty(const HtPlanParams& p) {
    const int R = p.num_ranks, B = p.num_tokens, C = p.channels;
    if (threadIdx.x == 0) {
        const int* done = reinterpret_cast<const int*>(p.scratch) + p.num_experts + 1;
        while (atomicAdd(const_cast<int*>(done), 0) < R) {
        }
    }
    __syncthreads();
    int* send_off = reinterpret_cast<int*>(p.send_off);
    for (int i = threadIdx.x; i < R * (C + 1); i += blockDim.x) send_off[i] = (i / (C + 1)) * B;
    for (int i = threadIdx.x; i < R * C; i += blockDim.x) {
        reinterpret_cast<int*>(p.recv_base)[i] = 0;
        reinterpret_cast<int*>(p.recv_cnt)[i] = 0;
    }
    int* copy_ord = reinterpret_cast<int*>(p.copy_ord);
    for (size_t i = threadIdx.x; i < (size_t)B * R; i += blockDim.x) copy_ord[i] = -1;
    for (int l = threadIdx.x; l < p.num_local; l += blockDim.x) reinterpret_cast<int*>(p.counts)[l] = 0;
    // The handle's routing too (a backward combine reads it): no entry names an expert.
    long long* topk = reinterpret_cast<long long*>(p.topk);
    for (size_t i = threadIdx.x; i < (size_t)B * p.top_k; i += blockDim.x) topk[i] = -1;
}

// Block R: waits for every source's message of exchange `seq`, then writes the receive layout,
// N and the rows per local expert.
__device__ __forceinline__ void plan_recv(const HtPlanParams& p) {
    __shared__ u32 cancelled, mismatched;
    __shared__ int warp_sums[32];
    const int R = p.num_ranks, C = p.channels, L = p.num_local, set = (int)(p.seq & 1);
    __shared__ int timed_out;
    const bool arrived = wait_all_sources(reinterpret_cast<u64*>(p.signals), reinterpret_cast<u64*>(p.status), R, 2,
                                          set, p.seq, p.stamp, p.timeout_ns, &cancelled, &mismatched, &timed_out);
    const int* own = reinterpret_cast<const int*>(p.own) + (size_t)set * R * p.words;
    long long* result = reinterpret_cast<long long*>(p.result);
    if (!arrived) {
        plan_empty(p);  // timed out: no outcome (the host reads the status page's error)
        return;
    }
    if (cancelled || mismatched) plan_empty(p);
    if (!cancelled && !mismatched) {
        // (source, channel) pairs in order, one per thread (R * C <= 8 * 128 = HT_PLAN_BLOCK).
        const int i = threadIdx.x;
        const int c = i < R * C ? __ldcg(own + (size_t)(i / C) * p.words + i % C) : 0;
        int n;
        const int base = plan_block_scan(c > 0 ? c : 0, warp_sums, &n);
        if (i < R * C) {
            reinterpret_cast<int*>(p.recv_base)[i] = base;
            reinterpret_cast<int*>(p.recv_cnt)[i] = c;
        }
        if (i == 0) result[3] = n;
        int* counts = reinterpret_cast<int*>(p.counts);
        for (int l = threadIdx.x; l < L; l += blockDim.x) {
            int sum = 0;
            for (int s = 0; s < R; ++s) sum += __ldcg(own + (size_t)s * p.words + C + l);
            counts[l] = sum;
            result[5 + l] = sum;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        if (!cancelled && !mismatched) {
            result[4] = (long long)p.seq + 1;  // built (after every array and word above)
            __threadfence_system();
        }
        publish_outcome(reinterpret_cast<u64*>(p.status), reinterpret_cast<u64*>(p.signals), 2, set, p.seq, cancelled,
                        mismatched);
    }
}

extern "C" __global__ void __launch_bounds__(HT_PLAN_BLOCK) ep_ht_plan(HtPlanParams p) {
    // A routing that fails validation anywhere cancels the exchange (every block sees it alike).
    const int K = p.top_k;
    const int bad_inv = p.cancelled ? 0 : __ldcg(reinterpret_cast<const int*>(p.scratch) + p.num_experts);
    const bool cancelled = p.cancelled || bad_inv != 0;
    if ((int)blockIdx.x == p.num_ranks) {
        plan_recv(p);
        return;
    }
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        long long* result = reinterpret_cast<long long*>(p.result);
        if (!p.cancelled && bad_inv != 0) {
            const int bad = 0x7fffffff - bad_inv;
            const long long* row = reinterpret_cast<const long long*>(p.topk) + (size_t)(bad / K) * K;
            const int k = bad % K;
            int first = -1;
            for (int j = 0; j < k; ++j) {
                if (first < 0 && row[j] == row[k]) first = j;
            }
            result[1] = row[k];
            result[2] = first;
        }
        result[0] = bad_inv == 0 ? -1 : 0x7fffffff - bad_inv;
    }
    plan_send(p, blockIdx.x, cancelled);
}

// epflow low-latency kernels, part 3 of 7 (after ll_tagged.cuh): the send side (warp roles,
// credits, the signals after a send, the dispatch send).

// The role of one warp in a send kernel: destination `dest` is served by `wpd` warps, this one is
// number `j` of them, and `reporting` of them (those with work: `j < items`, at least one) signal
// the destination when done. Returns false for spare warps and for those without items (they
// neither wait for credits nor report: at one token, most of a one-launch grid). Lane 0 waits for
// the destination's credit for this buffer set first (operation seq - S consumed).
struct SendRole {
    int dest, j, wpd, reporting, lane;
    bool skip;  // masking: `dest` (or this rank) is masked: no payload, no signal
};

// This warp's number in a send kernel's grid, and the warps each destination rank gets.
__device__ __forceinline__ int send_warp() { return blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); }
__device__ __forceinline__ int warps_per_dest(const LlParams& p) { return gridDim.x * (blockDim.x >> 5) / p.num_ranks; }

// The destination rank this warp of a send kernel serves (num_ranks or more: a spare warp), and
// its number among that destination's warps.
__device__ __forceinline__ int send_dest(const LlParams& p) { return send_warp() / warps_per_dest(p); }
__device__ __forceinline__ int send_j(const LlParams& p) { return send_warp() % warps_per_dest(p); }

__device__ __forceinline__ bool send_role(const LlParams& p, const OpNum& n, int chan, long long items, SendRole* r) {
    r->lane = threadIdx.x & 31;
    r->wpd = warps_per_dest(p);
    r->dest = send_dest(p);
    r->j = send_j(p);
    r->reporting = (int)(items < 1 ? 1 : (items < r->wpd ? items : r->wpd));
    return r->dest < p.num_ranks && r->j < r->reporting;
}

// Lane 0 waits for the role's destination's credit (all lanes call); sets `skip`.
__device__ __forceinline__ void role_wait_credit(const LlParams& p, const OpNum& n, int chan, SendRole* r, u64 first) {
    int skip = 0;
    if (r->lane == 0) {
        const u64 m = mask_word(p);
        skip = (int)either_masked(m, p.rank, r->dest);
        if (!skip) skip = wait_credit(p, n, chan, r->dest, first);
    }
    r->skip = __shfl_sync(EP_FULL_MASK, skip, 0) != 0;
}

// Reports this warp done with destination `dest`; the last of its `reporting` warps signals it.
// Only that last report is a system-scope release. Each warp's stores (possibly remote) are
// ordered before its report by the warp barrier and lane 0's GPU-scope acq_rel add of the count
// (every reporting warp is on this GPU); the last warp's add acquires every earlier one, and its
// release of the arrival word, at system scope, is cumulative over all of their stores (PTX
// causality order is transitive across scopes), so the receiver that acquires the word sees every
// payload. GPU scope for that release too when `dest` is this rank itself, whose stores all stay
// in this GPU. A system fence per warp cost 2-2.5 us per 128-token operation (benches/NOTES.md
// items 105 and 108). `rows` >= 0: a rank-major dispatch whose messages for `dest` sit compacted,
// that many (`arrival_word_compact`).
__device__ __forceinline__ void signal_sent(const LlParams& p, const OpNum& n, int chan, int dest, int reporting, int lane,
                                            int rows = -1) {
    __syncwarp();
    if (lane == 0) {
        u64* peer = reinterpret_cast<u64*>(p.peer_signals[dest]);
        u64* pair = arrival_at(peer, chan, n.set, p.rank);
        // The whole stamp (the word after the arrival word) goes out with this warp's payload,
        // before its report, so the arrival word's release waits for no store of its own.
        const u64 m0 = mask_word(p);
        if (!either_masked(m0, p.rank, dest)) st_relaxed_sys(pair + 1, p.stamp);
        const bool own = dest == p.rank;
        u64* sig = reinterpret_cast<u64*>(p.signals);
        u64* sent = sig_at(sig, EP_SIG_SENT(chan), n.set, dest);
        if (atom_add_acq_rel_gpu(sent, 1) == (u64)(reporting - 1)) {
            *sent = 0;
            const u64 m = mask_word(p);
            if (!either_masked(m, p.rank, dest)) {
                const u64 word = rows >= 0 && !p.cancelled ? arrival_word_compact(n.seq, p.stamp, rows)
                                                           : arrival_word(n.seq, p.cancelled != 0, p.stamp);
                if (own) {
                    st_release_gpu(pair, word);
                } else {
                    st_release_sys(pair, word);
                }
            }
        }
    }
}

// A captured dispatch reads the caller's top-k buffer, refilled before every replay, instead of
// the handle's copy; so does an eager dispatch on a handle created in a stream's order
// (`topk_src` set, `seq_base` 0: replay 0). Every warp sanitizes the row it sends (one entry per
// lane < K, all lanes call): the entries from the row's first invalid one on (outside [-1, E), or
// naming an expert an earlier entry named) count as -1. The `owner` warp of the token (chunk 0 to
// this rank itself, which no mask skips while this rank takes part) writes the sanitized row into
// the handle, which combine reads, and reports an invalid row in the handle's mapped report:
// value at [1 + B + t], then (replay + 1) << 16 | (earlier k + 1) << 8 | k at [1 + t], then the
// replay + 1 at [0] (every reporter writes the same value).
__device__ __forceinline__ long long routed_entry(const LlParams& p, long long e, int t, int lane, bool owner) {
    const int K = p.top_k;
    const long long E = (long long)p.num_local * p.num_ranks;
    const bool in_row = lane < K;
    const unsigned same = __match_any_sync(EP_FULL_MASK, in_row ? e : -2ll - lane);
    const unsigned below = same & ((1u << lane) - 1u);
    const bool bad = in_row && (e < -1 || e >= E || (e >= 0 && below != 0u));
    const unsigned bad_lanes = __ballot_sync(EP_FULL_MASK, bad);
    const int first = bad_lanes ? __ffs(bad_lanes) - 1 : K;
    const long long r = lane < first ? e : -1;
    if (owner) {
        if (in_row) reinterpret_cast<long long*>(p.topk_idx)[(size_t)t * K + lane] = r;
        if (bad_lanes != 0u && lane == first) {
            u64* rep = reinterpret_cast<u64*>(p.route_report);
            const u64 replay = p.seq_base ? __ldcg(reinterpret_cast<const u64*>(p.seq_base) + 2) : 0ull;
            const int earlier = (e >= 0 && below != 0u) ? __ffs(below) - 1 : -1;
            st_relaxed_sys(rep + 1 + p.num_tokens + t, (u64)e);
            st_relaxed_sys(rep + 1 + t, ((replay + 1) << 16) | ((u64)(earlier + 1) << 8) | (u64)first);
            __threadfence_system();
            st_relaxed_sys(rep, replay + 1);
        }
    }
    return r;
}

// Passes of 512 channels (16 per lane) whose loads an FP8 dispatch send keeps in flight together
// (1: at 2 the one-launch dispatch kernel spills, 24 B stored / 52 B loaded, sm_90, NVRTC 13.0.88).
#define EP_FP8_BATCH 1

// A forwarded dispatch's piece (`LlParams::fwd_token_bytes`): bytes [b0, b1) of token t's
// payload, taken from its token row (bytes below fwd_token_bytes) and its scale row (the next
// fwd_scale_bytes); bytes past both are neither written nor read by the receiver. Every bound
// is a multiple of 16. TAGGED: as pairs carrying `tag`, at twice the offsets.
template <bool TAGGED>
__device__ __forceinline__ void forwarded_payload(const LlParams& p, char* payload, int t, size_t b0, size_t b1,
                                                  int lane, u32 tag) {
    const size_t tb = (size_t)p.fwd_token_bytes, sb = (size_t)p.fwd_scale_bytes;
    const char* tok = reinterpret_cast<const char*>(p.x) + (size_t)t * tb;
    const char* sc = reinterpret_cast<const char*>(p.x_scales) + (size_t)t * sb;
    const size_t t1 = b1 < tb ? b1 : tb;
    if (b0 < t1) {
        if (TAGGED) {
            warp_copy_tagged(payload + 2 * b0, tok + b0, t1 - b0, lane, tag);
        } else {
            warp_copy(payload + b0, tok + b0, t1 - b0, lane);
        }
    }
    const size_t s0 = b0 > tb ? b0 : tb, s1 = b1 < tb + sb ? b1 : tb + sb;
    if (s0 < s1) {
        if (TAGGED) {
            warp_copy_tagged(payload + 2 * s0, sc + (s0 - tb), s1 - s0, lane, tag);
        } else {
            warp_copy(payload + s0, sc + (s0 - tb), s1 - s0, lane);
        }
    }
}

// Writes piece [c_begin, c_begin + width) of token t's row `row` into a dispatch message's
// payload at `payload`: BF16, or FP8 with its scales, or a forwarded row's bytes
// [2 c_begin, 2 (c_begin + width)) (FWD: the kernels of forwarded dispatches, compiled apart so
// that the others' registers are the same as without them). TAGGED: as pairs carrying `tag`
// (`payload` is the tagged payload, twice the plain bytes at twice the offsets).
template <bool TAGGED, bool FWD>
__device__ __forceinline__ void dispatch_payload(const LlParams& p, char* payload, int t, const __nv_bfloat16* row,
                                                 int c_begin, int width, int lane, u32 tag) {
    const int H = p.hidden, c_end = c_begin + width;
    if (FWD) {
        forwarded_payload<TAGGED>(p, payload, t, 2 * (size_t)c_begin, 2 * (size_t)c_end, lane, tag);
        return;
    }
    if (!p.fp8) {
        if (TAGGED) {
            warp_copy_tagged(payload + (size_t)c_begin * 4, reinterpret_cast<const char*>(row + c_begin),
                             (size_t)width * 2, lane, tag);
        } else {
            warp_copy(payload + (size_t)c_begin * 2, row + c_begin, (size_t)width * 2, lane);
        }
        return;
    }
    float* scales = reinterpret_cast<float*>(payload + H);
    // Passes of 512 channels, 16 per lane: two 16-byte loads and one 16-byte FP8 store
    // per lane (the width of the BF16 copy's stores; 8-byte stores made the FP8 send
    // slower than the BF16 copy of twice the bytes); a 128-channel scale block is 8
    // lanes. EP_FP8_BATCH passes' loads are issued together, then each is quantized
    // and stored. Chunks are multiples of 256 channels: a pass's lanes are active in
    // whole groups of 8.
    for (int c00 = c_begin; c00 < c_end; c00 += 512 * EP_FP8_BATCH) {
        int4 raw[2 * EP_FP8_BATCH];
#pragma unroll
        for (int u = 0; u < EP_FP8_BATCH; u++) {
            const int c = c00 + u * 512 + lane * 16;
            const bool in = c < c_end;
            raw[2 * u] = in ? ld_cg_int4(row + c) : make_int4(0, 0, 0, 0);
            raw[2 * u + 1] = in ? ld_cg_int4(row + c + 8) : make_int4(0, 0, 0, 0);
        }
#pragma unroll
        for (int u = 0; u < EP_FP8_BATCH; u++) {
            const int c = c00 + u * 512 + lane * 16;
            const bool active = c < c_end;
            const __nv_bfloat16* lo = reinterpret_cast<const __nv_bfloat16*>(&raw[2 * u]);
            const __nv_bfloat16* hi = reinterpret_cast<const __nv_bfloat16*>(&raw[2 * u + 1]);
            float amax = 0.f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                amax = fmaxf(amax, fmaxf(fabsf(__bfloat162float(lo[i])), fabsf(__bfloat162float(hi[i]))));
            }
#pragma unroll
            for (int m = 4; m >= 1; m >>= 1) amax = fmaxf(amax, __shfl_xor_sync(EP_FULL_MASK, amax, m));
            if (active) {
                float scale = __fdiv_rn(fmaxf(amax, 1e-4f), 448.0f);
                if (p.round_scales) scale = pow2_ceil(scale);
                const float inv = __fdiv_rn(1.0f, scale);
                u32 w[4];
#pragma unroll
                for (int q = 0; q < 4; q++) {
                    u32 word = 0u;
#pragma unroll
                    for (int i = 0; i < 4; i++) {
                        const int k = q * 4 + i;
                        const float v = __bfloat162float(k < 8 ? lo[k] : hi[k - 8]);
                        const u32 byte = (u32)__nv_cvt_float_to_fp8(__fmul_rn(v, inv), __NV_SATFINITE, __NV_E4M3);
                        word |= byte << (8 * i);
                    }
                    w[q] = word;
                }
                if (TAGGED) {
                    st_volatile_tagged(payload + 2 * c, w[0], w[1], tag);
                    st_volatile_tagged(payload + 2 * c + 16, w[2], w[3], tag);
                    if ((lane & 7) == 0) {
                        asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(payload + 2 * H + 8 * (c / 128)),
                                     "r"(__float_as_uint(scale)), "r"(tag)
                                     : "memory");
                    }
                } else {
                    st_na_int4(payload + c, make_int4((int)w[0], (int)w[1], (int)w[2], (int)w[3]));
                    if ((lane & 7) == 0) scales[c / 128] = scale;
                }
            }
        }
    }
}

// A tagged dispatch's item (token `t`, piece `chunk`) for destination `dest`, in message `slot`
// of its tagged area (`t`, or compacted its place among the tokens routed there): the header
// with piece 0, the payload piece if the token is `routed` there (lane k < K holds entry k's
// local expert there, `le`).
template <bool FWD>
__device__ __forceinline__ void send_tagged_item(const LlParams& p, const OpNum& n, int dest, int t, int slot,
                                                 int chunk, int le, bool routed, int lane) {
    const int K = p.top_k, H = p.hidden, width = H / p.chunks;
    const u32 tag = op_tag(n.seq);
    char* msg = tagged_msg(p, p.peer_recv[dest], n.set, p.rank, slot);
    if (chunk == 0) {
        const float* w = reinterpret_cast<const float*>(p.weights);
        const float wt = p.rank_major && lane < K ? w[(size_t)t * K + lane] : 0.f;
        put_head_tagged(msg, p, n, t, le, wt, lane, tag);
    }
    if (routed) {
        const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(p.x);
        dispatch_payload<true, FWD>(p, msg + 2 * EP_HDR_BYTES, t, x + (size_t)t * H, chunk * width, width, lane, tag);
    }
}

// Each destination rank is served by `warps / R` warps; warp j of destination d handles the
// (token, chunk) items j, j + wpd, ... of d (a row is split into `chunks` equal pieces, a multiple
// of 256 channels each, so many warps move one row). When all of them are done, the last one
// signals d. Each warp fences its stores before it reports (`signal_sent`), so the signal is
// ordered after every payload store of every lane. Tagged (`sends_tagged`): the first warp of
// each destination signals at once, and the messages go out as pairs. Compacted (`send_slot`, a
// rank-major dispatch to a destination over NVLink, plain or tagged): token t's message takes
// the slot the handle gives it for d, a token routed elsewhere sends nothing (not even a tagged
// header), and the arrival word carries their number.
// SEND: which form the kernel sends in (`SEND_ANY`: as `sends_tagged` says; the one-launch
// kernels are compiled for one form each, picked by the host's mirror `LlParams::sends_tagged`:
// with both sends inlined, the plain one-launch kernel spilled 170 B instead of 20). FWD: a
// forwarded dispatch's kernels (`LlParams::fwd_token_bytes`).
#define SEND_ANY 0
#define SEND_PLAIN 1
#define SEND_TAGGED 2
template <int SEND, bool FWD>
__device__ __forceinline__ void dispatch_send(const LlParams& p, const OpNum& n) {
    SendRole role;
    if (!send_role(p, n, 0, (long long)p.num_tokens * p.chunks, &role)) return;
    const int lane = role.lane, dest = role.dest, j = role.j, wpd = role.wpd;
    const int K = p.top_k, H = p.hidden, L = p.num_local, C = p.chunks;
    const long long* idx = reinterpret_cast<const long long*>(p.topk_src ? p.topk_src : p.topk_idx);
    // The first item's routing row (and compacted slot) is loaded before the credit wait (its
    // latency overlaps it).
    const long long e_first = (lane < K && j < p.num_tokens * C) ? idx[(size_t)(j / C) * K + lane] : -1;
    const bool tagged = SEND == SEND_TAGGED || (SEND == SEND_ANY && sends_tagged(p));
    // Not to this rank itself in a group with NCCL peers: its arrival pair is also the one NCCL
    // carries to them (`signal_sent` writes theirs into this rank's own page), which must stay a
    // plain word.
    const bool compact = p.send_slot != 0ull && !via_nccl(p, dest) && !(dest == p.rank && p.nccl_mask != 0);
    const int* slots = reinterpret_cast<const int*>(p.send_slot + (u64)dest * p.max_tokens * sizeof(int));
    const int slot_first = compact && j < p.num_tokens * C ? __ldg(slots + j / C) : -1;
    // The count the arrival word announces (loaded before the credit wait too).
    const int announced = compact ? announced_rows(p, dest) : -1;
    const u64 credit = lane == 0 ? credit_first_look(p, n, 0, dest) : 0ull;
    role_wait_credit(p, n, 0, &role, credit);
    if (tagged && j == 0 && lane == 0 && !role.skip) signal_now(p, n, 0, dest, p.num_tokens, announced);

    if (!p.cancelled && !role.skip) {
        const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(p.x);
        char* region = via_nccl(p, dest)
                           ? reinterpret_cast<char*>(p.nccl_out) + (size_t)dest * p.nccl_dest_bytes
                           : reinterpret_cast<char*>(p.peer_recv[dest]) + (size_t)n.set * p.recv_set_bytes +
                                 (size_t)p.rank * p.max_tokens * p.msg_bytes;
        const int width = H / C;  // channels per chunk
        for (int item = j; item < p.num_tokens * C; item += wpd) {
            const int t = item / C, chunk = item % C;
            long long e = item == j ? e_first : (lane < K ? idx[(size_t)t * K + lane] : -1);
            const int slot = !compact ? t : item == j ? slot_first : __ldg(slots + t);
            if (p.topk_src) e = routed_entry(p, e, t, lane, dest == p.rank && chunk == 0);
            // 32-bit: a routed expert is below E (validated, or sanitized by `routed_entry`).
            const int le = (lane < K && e >= 0 && (int)e / L == dest) ? (int)e % L : -1;
            const bool routed = __ballot_sync(EP_FULL_MASK, le >= 0) != 0u;
            if (tagged) {
                if (routed || !compact) send_tagged_item<FWD>(p, n, dest, t, slot, chunk, le, routed, lane);
                continue;
            }
            if (!routed) continue;
            char* msg = region + (size_t)slot * p.msg_bytes;
            if (chunk == 0) {
                if (lane < K) reinterpret_cast<short*>(msg + 16)[lane] = (short)le;
                if (p.rank_major && lane < K) {
                    reinterpret_cast<float*>(msg + EP_HDR_WEIGHTS)[lane] =
                        reinterpret_cast<const float*>(p.weights)[(size_t)t * K + lane];
                }
                if (lane == 0) {
                    *reinterpret_cast<u64*>(msg) = n.seq + 1;
                    *reinterpret_cast<int*>(msg + 8) = t;
                    *reinterpret_cast<int*>(msg + 12) = wants_tagged(p) ? 1 : 0;
                }
            }
            dispatch_payload<false, FWD>(p, msg + EP_HDR_BYTES, t, x + (size_t)t * H, chunk * width, width, lane, 0u);
        }
    }
    if (!tagged) signal_sent(p, n, 0, dest, role.reporting, lane, announced);
}


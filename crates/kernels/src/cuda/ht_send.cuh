// epflow high-throughput kernels, part 2 of 5 (after ht_rings.cuh): the sending warps (their
// roles, the ring sends and the direct dispatch).

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

// One check of a sending warp's wait on destination `dest` (ring space, a receiver's addresses,
// its reads): true, stop waiting, once `dest` has set this operation's abort word (it skips this
// rank's rows: a mismatch it reported) or the deadline has passed (reported as a ring timeout).
__device__ __forceinline__ bool ht_send_gives_up(const HtParams& p, int dest, u64 deadline) {
    const u64* abort = sig_at(reinterpret_cast<u64*>(p.signals), EP_SIG_ABORT(p.chan), (int)(p.seq & 1), dest);
    if (ld_acquire_sys(abort) == p.seq + 1) return true;
    if (globaltimer_ns() > deadline) {
        report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_RING, dest, p.seq);
        return true;
    }
    return false;
}

// Direct dispatch: waits (one warp, all lanes call) until the receiver `dest` of channel c has
// told this operation's addresses (`ht_direct`): 1 with them in `addr` (addr[0] == 0: the receiver
// asked for the ring), 0 when giving up (`ht_send_gives_up`). Lane w < 10 waits for word w of the
// slot (five tagged values: four addresses, the stamp); lane 0 watches the abort word and the
// deadline. A slot whose stamp differs is a stale one (another handle's, 2^32 operations ago): a
// receiver running another operation with this number reports the mismatch and sets the abort
// word instead. A `helper` (`ht_help_direct`, run by a receiving block before it checks its
// sources) also gives up, silently, once `dest`'s start signal of this operation names another
// stamp: `dest`'s abort word comes from its receiving block, which may itself be helping, and
// waiting for a slot of this rank that a mismatched handle never has it write (its count is
// below `direct`), so only this check keeps the two blocks from waiting for each other until
// the deadline; the mismatch is then reported by the receive (`ht_wait_starts`).
__device__ int ht_direct_addresses(const HtParams& p, int c, int dest, u64 addr[4], bool helper) {
    const int lane = threadIdx.x & 31;
    const u64* slot = ht_direct(reinterpret_cast<u64*>(p.signals), p.chan, c, dest);
    const u32 tag = ht_slot_tag(p.seq);
    u32 half = 0;
    bool have = lane >= 10;
    int fail = 0;
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    while (true) {
        if (!have) have = ht_get_tagged(slot, lane, tag, &half);
        if (__all_sync(EP_FULL_MASK, have)) {
            const u64 stamp = ((u64)__shfl_sync(EP_FULL_MASK, half, 9) << 32) | __shfl_sync(EP_FULL_MASK, half, 8);
            if (stamp == p.stamp) break;
            have = lane >= 10;
        }
        if (lane == 0) {
            fail = ht_send_gives_up(p, dest, deadline);
            if (helper && !fail) {
                u64* start = arrival_at(reinterpret_cast<u64*>(p.signals), p.chan, (int)(p.seq & 1), dest);
                const u64 v = ld_acquire_sys(start);
                fail = arrival_is(v, p.seq) && arrival_verdict(v, p.stamp) == EP_ARRIVED_MISMATCH;
            }
        }
        if (__shfl_sync(EP_FULL_MASK, fail, 0)) return 0;
    }
#pragma unroll
    for (int u = 0; u < 4; u++) {
        addr[u] = ((u64)__shfl_sync(EP_FULL_MASK, half, 2 * u + 1) << 32) | __shfl_sync(EP_FULL_MASK, half, 2 * u);
    }
    return 1;
}

// Direct dispatch with `p.helpers` helping warps per remote destination: of a (destination,
// channel) pair's `n` rows the sending block's W warps write the first ones, the helpers the
// rest, in proportion to their warps (every row when there are no helpers).
__device__ __forceinline__ int ht_direct_split(const HtParams& p, int n) {
    const long long W = p.warps_per_dest, all = W + p.helpers;
    return p.helpers > 0 ? (int)(((long long)n * W + all - 1) / all) : n;
}

// The next row of a pool (`ht_pool`'s word 0) for the calling warp: lane 0 takes it, every lane
// gets it.
__device__ __forceinline__ int ht_pool_take(unsigned* take, int lane) {
    unsigned v = 0;
    if (lane == 0) v = atomicAdd(take, 1u);
    return (int)__shfl_sync(EP_FULL_MASK, v, 0);
}

// Direct dispatch: writes rows i = i0, i0 + step, ... below `n` of `list` at the receiver's
// addresses `addr` (one warp); with `take` (a pool's word 0, `ht_pooled`), the rows it hands out
// below `n` instead, asking for the next before it copies the current one.
__device__ __forceinline__ void ht_direct_rows(const HtParams& p, int dest, const u64 addr[4], const int* list, int i0,
                                               int step, int n, unsigned* take) {
    const int lane = threadIdx.x & 31;
    const int cols = p.scale_cols, K = p.top_k;
    for (int i = take ? ht_pool_take(take, lane) : i0; i < n;) {
        unsigned next = 0;
        if (take && lane == 0) next = atomicAdd(take, 1u);
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
        i = take ? (int)__shfl_sync(EP_FULL_MASK, next, 0) : i + step;
    }
}

// Dispatch to this rank: rows i = i0, i0 + step, ... below `n` of `list` (one warp) into output
// rows `row0 + i`; with `take`, the rows the pool hands out instead: `ht_direct_rows` with this
// rank's outputs from row `row0` as the addresses.
__device__ __forceinline__ void ht_own_rows(const HtParams& p, const int* list, size_t row0, int i0, int step, int n,
                                            unsigned* take) {
    const size_t cols = (size_t)p.scale_cols, K = (size_t)p.top_k;
    const u64 addr[4] = {p.out + row0 * p.row_bytes, p.out_scales + row0 * cols * sizeof(float),
                         p.out_weights + row0 * K * sizeof(float), p.out_idx + row0 * K * sizeof(long long)};
    ht_direct_rows(p, p.rank, addr, list, i0, step, n, take);
}

// Balanced direct dispatch (`HtParams::balanced`; one warp, all lanes call): whether this
// operation shares out this rank's rows for `dest` between the warps of every channel as they go
// (`ht_pool`), rather than a fixed share per channel. The sending blocks' speeds differ by up to
// 2x (benches/NOTES.md item 154), so with fixed shares the last blocks' rows end the dispatch
// while the others idle. Every warp with rows for `dest` decides the same: the pool must be ready
// for this operation and, for a peer, every channel with rows must take them directly (at least
// `p.direct`: its receiving block then only waits for the channel's subtails, which the pool's
// last warp publishes, `ht_pool_done`).
__device__ bool ht_pooled(const HtParams& p, int dest) {
    if (!p.balanced || p.direct <= 0 || p.cancelled) return false;
    // Written by the kernel of the operation before (L2, not a stale L1 line).
    if (__ldcg(ht_pool(reinterpret_cast<u64*>(p.signals), dest, p.seq) + 2) != p.seq) return false;
    if (dest == p.rank) return true;
    const int C = p.channels, lane = threadIdx.x & 31;
    const int* off = reinterpret_cast<const int*>(p.send_off) + dest * (C + 1);
    bool ok = true;
    for (int c = lane; c < C; c += 32) {
        const int n = off[c + 1] - off[c];
        ok = ok && (n == 0 || n >= p.direct);
    }
    return __all_sync(EP_FULL_MASK, ok);
}

// A pooled destination's rows (`ht_pooled`; one warp, all lanes call): their number, with
// `*list` their first entry of the send list and `*c` the first channel with rows (whose
// receiver's addresses serve them all: a source's rows are contiguous in the receiver's output,
// in channel order, as in its send list).
__device__ __forceinline__ int ht_pool_rows(const HtParams& p, int dest, int* c, const int** list) {
    const int C = p.channels, lane = threadIdx.x & 31;
    const int* off = reinterpret_cast<const int*>(p.send_off) + dest * (C + 1);
    int first = C;
    for (int c0 = 0; c0 < C && first == C; c0 += 32) {
        const unsigned has = __ballot_sync(EP_FULL_MASK, c0 + lane < C && off[c0 + lane + 1] > off[c0 + lane]);
        if (has) first = c0 + __ffs(has) - 1;
    }
    *c = first;
    *list = reinterpret_cast<const int*>(p.send_list) + off[0];
    return off[C] - off[0];
}

// Balanced direct dispatch to peer `dest`, after a warp's rows (a sending warp's or a helper's):
// fences them and counts the warp done in the pool's word 1; the last of the pool's warps
// (every channel's sending warps for `dest` and its helpers) publishes the final subtail of
// every channel with rows, the release of them all.
__device__ void ht_pool_done(const HtParams& p, int dest) {
    const int lane = threadIdx.x & 31, C = p.channels, W = p.warps_per_dest;
    __threadfence_system();
    __syncwarp();
    u64* pool = ht_pool(reinterpret_cast<u64*>(p.signals), dest, p.seq);
    unsigned long long before = 0;
    if (lane == 0) before = atomicAdd(reinterpret_cast<unsigned long long*>(pool + 1), 1ull);
    before = __shfl_sync(EP_FULL_MASK, before, 0);
    if (before + 1 < (u64)C * (u64)(W + p.helpers)) return;
    // The last warp: the fences above and the other warps' (each before its count) make these
    // relaxed stores the release of every row (as `ht_send_direct`'s helpers).
    __threadfence_system();
    u64* sig = reinterpret_cast<u64*>(p.signals);
    u64* peer_sig = reinterpret_cast<u64*>(p.peer_signals[dest]);
    const int* off = reinterpret_cast<const int*>(p.send_off) + dest * (C + 1);
    for (int i = lane; i < C * W; i += 32) {
        const int c = i / W, r = i % W;
        const int rows = off[c + 1] - off[c];
        if (rows == 0) continue;
        // Every item of residue r below the end counts as written (the cancelled sender's rule).
        const u64 end = *ht_prod(sig, p.chan, c, dest, p.seq) + (u64)rows;
        st_relaxed_sys(ht_subtail(peer_sig, p.chan, c, p.rank, r), (end + (u64)W - 1 - (u64)r) / (u64)W);
    }
}

// Balanced direct dispatch: at the kernel's start (block 0), makes the pools ready for the next
// operation (`ht_pool`'s words of the other parity), which runs after this kernel.
__device__ __forceinline__ void ht_pool_prepare(const HtParams& p) {
    if (blockIdx.x == 0 && (int)threadIdx.x < p.num_ranks) {
        u64* pool = ht_pool(reinterpret_cast<u64*>(p.signals), threadIdx.x, p.seq + 1);
        pool[0] = 0;
        pool[1] = 0;
        pool[2] = p.seq + 1;
    }
}

// Direct dispatch, one sending warp of destination `dest` (see ht_rings.cuh): waits for
// the receiver's addresses, writes the warp's rows i = j, j + W, ... of its share of `list`
// (`n` rows, the first at ring position `pos0`; `ht_direct_split`) there, waits for the
// helpers' rows (`ht_help_direct`), then publishes the warp's final subtail. With `pooled`
// (`ht_pooled`), the rows of every channel for `dest` as the pool hands them out instead, and
// then `ht_pool_done`. False, having written nothing, when the receiver asked for the ring
// instead.
__device__ bool ht_send_direct(const HtParams& p, int c, int dest, int j, int W, int n, u64 pos0, const int* list,
                               bool pooled) {
    const int lane = threadIdx.x & 31;
    int cc = c, mine = n;
    if (pooled) {
        mine = ht_pool_rows(p, dest, &cc, &list);
        if (mine == 0) return true;  // no rows: no channel waits for a subtail
    } else {
        mine = ht_direct_split(p, n);
    }
    u64 addr[4];
    if (!ht_direct_addresses(p, cc, dest, addr, false)) return true;
    if (addr[0] == 0) return false;
    unsigned* take =
        pooled ? reinterpret_cast<unsigned*>(ht_pool(reinterpret_cast<u64*>(p.signals), dest, p.seq)) : nullptr;
    ht_direct_rows(p, dest, addr, list, j, W, mine, take);
    if (pooled) {
        ht_pool_done(p, dest);
        return true;
    }
    int fail = 0;
    if (lane == 0 && mine < n) {
        // The helpers' rows: each helper's fence and strong store of its word are its release.
        const u64 deadline = globaltimer_ns() + p.timeout_ns;
        const u64* helped = ht_helped(reinterpret_cast<u64*>(p.signals), c, dest, 0);
        for (int h = 0; h < p.helpers && !fail; h++) {
            while (ld_acquire_sys(helped + h) != p.seq + 1) {
                if (ht_send_gives_up(p, dest, deadline)) {
                    fail = 1;
                    break;
                }
            }
        }
    }
    if (__shfl_sync(EP_FULL_MASK, fail, 0)) return true;
    __threadfence_system();
    __syncwarp();
    if (lane == 0) {
        // Every item of residue r below the end counts as written (the cancelled sender's rule).
        // The system fence above and this strong store are the release (no second fence); it
        // is cumulative over the helpers' rows, whose release lane 0 acquired.
        const u64 r = (pos0 + (u64)j) % (u64)W, end = pos0 + (u64)n;
        st_relaxed_sys(ht_subtail(reinterpret_cast<u64*>(p.peer_signals[dest]), p.chan, c, p.rank, (int)r),
                       (end + (u64)W - 1 - r) / (u64)W);
    }
    return true;
}

// Direct dispatch, the receiving block of channel c before it receives (`ht_dispatch_recv`):
// `p.helpers` of its warps per remote destination write the last rows of this rank's share for
// that destination on channel c (`ht_direct_split`), where a direct send takes them, so that a
// dispatch on few SMs stores to NVLink from every block, not from the sending half only (the
// receiving block of a direct pair only waits). Helper h then stores the operation number + 1
// in its word (`ht_helped`), which the pair's sending warps wait for. With a pooled destination
// (`ht_pooled`), the helpers take rows from the pool as the sending warps do, and count
// themselves done there (`ht_pool_done`). It waits only for the receiver's addresses, which
// every receiving block publishes before it waits for anything, so a receive delayed by its help
// delays no address, and gives up when the receiver's start signal names another stamp (see
// `ht_direct_addresses`). Nothing when the pair goes through the ring (fewer rows than
// `direct`, or a null address: then the sending warps wait for no helper).
__device__ void ht_help_direct(const HtParams& p, int c) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int HW = p.helpers, R = p.num_ranks, C = p.channels;
    if (HW <= 0 || p.direct <= 0 || p.cancelled || R < 2) return;
    const int q = warp / HW, h = warp % HW;
    if (q >= R - 1) return;
    const int dest = q < p.rank ? q : q + 1;
    const bool pooled = ht_pooled(p, dest);
    const int* send_off = reinterpret_cast<const int*>(p.send_off);
    const int* list = reinterpret_cast<const int*>(p.send_list) + send_off[dest * (C + 1) + c];
    int cc = c, n = send_off[dest * (C + 1) + c + 1] - send_off[dest * (C + 1) + c], first = 0;
    if (pooled) {
        n = ht_pool_rows(p, dest, &cc, &list);
        if (n == 0) return;
    } else {
        first = ht_direct_split(p, n);
        if (n < p.direct || first >= n) return;
    }
    u64 addr[4];
    if (!ht_direct_addresses(p, cc, dest, addr, true) || addr[0] == 0) return;
    unsigned* take =
        pooled ? reinterpret_cast<unsigned*>(ht_pool(reinterpret_cast<u64*>(p.signals), dest, p.seq)) : nullptr;
    ht_direct_rows(p, dest, addr, list, first + h, HW, n, take);
    if (pooled) {
        ht_pool_done(p, dest);
        return;
    }
    __threadfence_system();
    __syncwarp();
    // The fence above and this strong store are the release of the rows.
    if (lane == 0) st_relaxed_sys(ht_helped(reinterpret_cast<u64*>(p.signals), c, dest, h), p.seq + 1);
}

// Pull combine, one sending warp of destination `dest` (see ht_rings.cuh) with `n` rows, the
// first at ring position `pos0`: warp 0 tells `dest` where the rows are in this rank's expert
// output (null: the ring); with the rows offered, every warp publishes its final subtail (no
// data goes through the ring) and `ht_await_readers` later waits until `dest` has read them.
// False when this rank's expert outputs are not readable by peers (the ring then carries them).
__device__ bool ht_offer_rows(const HtParams& p, int c, int dest, int j, int W, int n, u64 pos0) {
    const int lane = threadIdx.x & 31;
    const bool offer = p.direct_mem != 0;
    u64* peer_sig = reinterpret_cast<u64*>(p.peer_signals[dest]);
    if (j == 0 && lane == 0) {
        u64* slot = ht_direct(peer_sig, p.chan, c, p.rank);
        const u64 row0 = (u64)reinterpret_cast<const int*>(p.recv_base)[dest * p.channels + c];
        const u32 tag = ht_slot_tag(p.seq);
        ht_put_tagged(slot, 0, offer ? p.x + row0 * (u64)p.row_bytes : 0, tag);
        ht_put_tagged(slot, 1, offer && p.backward ? p.weights + row0 * (u64)p.top_k * 4 : 0, tag);
        ht_put_tagged(slot, 2, p.stamp, tag);
    }
    if (!offer) return false;
    if (lane == 0) {
        const u64 r = (pos0 + (u64)j) % (u64)W, end = pos0 + (u64)n;
        st_release_sys(ht_subtail(peer_sig, p.chan, c, p.rank, (int)r), (end + (u64)W - 1 - r) / (u64)W);
    }
    return true;
}

// Pull combine, the sending block of channel c after its sends: waits until every destination
// it offered rows to has read them (their head at the end), so that the expert output outlives
// their reads. A destination that skips this rank (a mismatch) sets the abort word instead.
__device__ void ht_await_readers(const HtParams& p, int c) {
    const int dest = threadIdx.x;
    if (dest >= p.num_ranks || dest == p.rank || p.cancelled || p.direct <= 0 || p.direct_mem == 0) return;
    const int n = reinterpret_cast<const int*>(p.recv_cnt)[dest * p.channels + c];
    if (n < p.direct) return;
    u64* sig = reinterpret_cast<u64*>(p.signals);
    const u64 end = *ht_prod(sig, p.chan, c, dest, p.seq) + (u64)n;
    const u64* head = ht_head(sig, p.chan, c, dest);
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    while (ld_acquire_sys(head) < end) {
        if (ht_send_gives_up(p, dest, deadline)) return;
    }
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
    const int cols = p.scale_cols;

    if (dest == p.rank) {
        // Dispatch to this rank: straight into the output rows. Combine: the receiver reads them.
        if (!DISPATCH || p.cancelled) return;
        // Balanced: every channel's rows for this rank as its pool hands them out (this rank's
        // rows from itself are contiguous in its output, in channel order).
        const bool pooled = ht_pooled(p, dest);
        const int first = pooled ? send_off[dest * (C + 1)] : send_off[dest * (C + 1) + c];
        const int rows = pooled ? send_off[dest * (C + 1) + C] - first : n;
        const int row0 = reinterpret_cast<const int*>(p.recv_base)[p.rank * C + (pooled ? 0 : c)];
        unsigned* take =
            pooled ? reinterpret_cast<unsigned*>(ht_pool(reinterpret_cast<u64*>(p.signals), dest, p.seq)) : nullptr;
        ht_own_rows(p, reinterpret_cast<const int*>(p.send_list) + first, (size_t)row0, j, W, rows, take);
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
    if (DISPATCH && p.direct > 0) {
        const bool pooled = ht_pooled(p, dest);
        if ((pooled || n >= p.direct) && ht_send_direct(p, c, dest, j, W, n, pos0, list, pooled)) return;
    }
    if (!DISPATCH && p.direct > 0 && n >= p.direct && ht_offer_rows(p, c, dest, j, W, n, pos0)) return;
    const u64* head = ht_head(sig, p.chan, c, dest);
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    const int K = p.top_k, U = p.items_per_fence;
    // Groups of U items (i0, i0 + W, ...): written back to back, then one fence and one subtail.
    for (int i0 = j; i0 < n; i0 += W * U) {
        const int last = min(i0 + (U - 1) * W, i0 + (n - 1 - i0) / W * W);
        const u64 g_last = pos0 + (u64)last;
        int fail = 0;
        if (lane == 0) {
            while (ld_acquire_sys(head) + (u64)p.depth <= g_last) {
                if (ht_send_gives_up(p, dest, deadline)) {
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
            // The fence above and this strong store are the release.
            st_relaxed_sys(ht_subtail(peer_sig, p.chan, c, p.rank, (int)(g_last % (u64)W)), g_last / (u64)W + 1);
        }
    }
}

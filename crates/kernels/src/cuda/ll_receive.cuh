// epflow low-latency kernels, part 4 of 7 (after ll_send.cuh): the receive side's waits and
// finish (arrivals, masking, credits returned), and the dispatch receive.

// With masking: one thread per source waits for its arrival until it arrives, is masked (by a
// peer, or here at the deadline: `spread_mask`), or this rank is masked. Then the first block of
// the operation to get past its waits decides the absent sources for every block: the mask as it
// stands then (it holds every source that block gave up on, so every source it leaves present
// has arrived). Every thread of the block calls it; ends with a barrier. `compact` (shared, or
// null): as in `wait_all_sources`.
__device__ void wait_sources_masked(const LlParams& p, const OpNum& n, int chan, u32* cancelled, u32* mismatched,
                                    u32* absent, int* compact) {
    u64* sig = reinterpret_cast<u64*>(p.signals);
    if (threadIdx.x == 0) {
        *cancelled = 0u;
        *mismatched = 0u;
    }
    const int s = threadIdx.x;
    if (compact && s < p.num_ranks) compact[s] = -1;
    if (s < p.num_ranks) {
        const u64 m0 = mask_word(p);
        bool gave_up = either_masked(m0, p.rank, s);
        const u64* a = arrival_at(sig, chan, n.set, s);
        const u64 deadline = globaltimer_ns() + p.timeout_ns;
        while (!gave_up && !arrival_is(ld_acquire_sys(a), n.seq)) {
            if ((mask_word(p) >> s) & 1ull) {
                gave_up = true;
            } else if (globaltimer_ns() > deadline) {
                spread_mask(p, 1ull << s);
                gave_up = true;
            }
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        u64* d = mask_area(sig) + EP_MASK_DECISION + chan * EP_MAX_SETS + n.set;
        const u64 mine = ((n.seq + 1) << 8) | (mask_word(p) & 0xffull);
        u64 cur = ld_acquire_sys(d);
        while ((cur >> 8) != n.seq + 1) {
            const u64 prev = atomicCAS(d, cur, mine);
            cur = prev == cur ? mine : prev;
        }
        *absent = (u32)(cur & 0xffull);
    }
    __syncthreads();
    if (s < p.num_ranks && !((*absent >> s) & 1u)) {
        // Present: it arrived (for the deciding block, so here too; the deadline only guards).
        const u64 deadline = globaltimer_ns() + p.timeout_ns;
        u64 word = 0ull;
        const int v = wait_arrival(sig, chan, n.set, s, n.seq, p.stamp, deadline, &word);
        if (compact) compact[s] = arrival_compact_rows(word);
        if (v == EP_ARRIVED_CANCELLED) atomicOr(cancelled, 1u << s);
        if (v == EP_ARRIVED_MISMATCH) atomicOr(mismatched, 1u << s);
        if (v == EP_ARRIVAL_TIMEOUT) report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_ARRIVAL, s, n.seq);
    }
    __syncthreads();
}

// Waits for every source's arrival of this operation (`wait_all_sources`); false on timeout.
// Cancelled and mismatched sources' data is skipped; a mismatch fails the operation. With
// masking (`wait_sources_masked`) it never fails: `absent` gets the sources to skip.
// `sent` (shared, or null): per source, the tokens of a tagged dispatch, or -1 (see
// `wait_all_sources`; never tagged with masking); `compact` (shared, or null): per source, its
// compacted rank-major messages, or -1.
__device__ bool ll_wait_all_sources(const LlParams& p, const OpNum& n, int chan, u32* cancelled, u32* mismatched,
                                    int* timed_out, u32* absent, int* sent = nullptr, int* compact = nullptr) {
    if (p.masking) {
        if (sent && (int)threadIdx.x < p.num_ranks) sent[threadIdx.x] = -1;
        wait_sources_masked(p, n, chan, cancelled, mismatched, absent, compact);
        return true;
    }
    if (threadIdx.x == 0) *absent = 0u;
    const bool ok = wait_all_sources(reinterpret_cast<u64*>(p.signals), reinterpret_cast<u64*>(p.status), p.num_ranks,
                                     chan, n.set, n.seq, p.stamp, p.timeout_ns, cancelled, mismatched, timed_out, sent,
                                     compact);
    if (!ok && threadIdx.x == 0) mark_step_failed(p, chan);
    return ok;
}

// A captured operation that some source cancelled or mismatched: the step's failure word (mapped
// host) keeps the first one it saw, ((seq + 1) << 20) | chan << 16 | mismatched << 8 | cancelled
// (the host reads it after the replay and poisons the group). Plain loads and stores: the
// step's operations finish in stream order, and mapped memory takes no system atomics on every
// platform.
__device__ __forceinline__ void report_failure(const LlParams& p, const OpNum& n, int chan, u32 cancelled, u32 mismatched) {
    const u64 word = ((n.seq + 1) << 20) | ((u64)chan << 16) | ((u64)(mismatched & 0xff) << 8) | (cancelled & 0xff);
    u64* v = reinterpret_cast<u64*>(p.verdict);
    if (ld_acquire_sys(v) == 0ull) st_relaxed_sys(v, word);
}

// A captured operation whose receive is the step's last kernel (of ours): once its last block is
// done, every kernel of this replay has read the bases (they run in the capture stream's order,
// and this block is the last of the last one), so they move past the replay here, with no node
// of their own. The step's bases are [dispatch, combine, replay, failed, dispatches, combines,
// last]: `last` = (chan << 32 | place) + 1 of the step's last operation, written at capture.
// Operations numbered on the device one by one (`graph/numbered.rs`: `last` is
// EP_NUMBERED_PER_OP) move their own channel's base on by one instead: every operation's receive
// (or one-launch kernel) ends with it, in the stream's order.
__device__ __forceinline__ void advance_step(const LlParams& p, int chan) {
    u64* b = reinterpret_cast<u64*>(p.seq_base) - chan;
    if (b[6] == EP_NUMBERED_PER_OP) {
        b[chan] += 1;
        return;
    }
    if (b[6] != ((((u64)chan) << 32) | p.seq) + 1) return;
    b[0] += b[4];
    b[1] += b[5];
    b[2] += 1;
}

// Block 0 publishes the operation's outcome (the cancelled, mismatched and absent sources, for the
// host) as soon as its wait judged the sources: every block judges them alike. The host reads it
// while polling and after the kernel completed; no later operation on this set runs on this rank
// before this one's verdict was read (its buffer set's lease), so nothing else orders it.
__device__ __forceinline__ void publish_early(const LlParams& p, const OpNum& n, int chan, u32 cancelled, u32 mismatched,
                                              u32 absent) {
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        publish_outcome(reinterpret_cast<u64*>(p.status), reinterpret_cast<u64*>(p.signals), chan, n.set, n.seq,
                        cancelled | (absent << 8), mismatched);
    }
}

// `sig_at(.., EP_SIG_DONE, set, EP_DONE_LANDED)`: the blocks of a dispatch's one-launch kernel
// done with `land_tagged` (the array's entries 0..2 are the channels' `done` counts).
#define EP_DONE_LANDED 3

// The last block's thread 0, once every block is `done`: returns the credits of this buffer set
// to every source, then resets the count and writes the host's words.
__device__ __forceinline__ void return_credits(const LlParams& p, const OpNum& n, int chan, u32 cancelled,
                                               u32 mismatched, u32 absent, u64* done) {
    if (p.trace) ep_ll_trace[chan][5] = globaltimer_ns();
    // One release fence for all the credits, with the relaxed stores after it: it orders every
    // block's reads of this set, and its clearing of tagged areas there (all before each block's
    // gpu-scope release add of `done`, which this thread acquired), before the credits. GPU scope
    // is enough: a source's next writes into this set land in this GPU's memory through its L2,
    // where those reads and stores were performed, so no read sees such a write and no clearing
    // store lands after one. A system-scope fence here waited ~1.5 us for this
    // GPU's outstanding stores to the host and to peers, at the end of every operation
    // (benches/NOTES.md item 104). This thread's own stores come after the credits, so the fence
    // waits for none of them (item 170).
    asm volatile("fence.acq_rel.gpu;" ::: "memory");
    for (int s = 0; s < p.num_ranks; s++) {
        if ((absent >> s) & 1u) continue;  // masked: no credit (it may be gone; rejoin resets them)
        u64* peer = reinterpret_cast<u64*>(p.peer_signals[s]);
        st_relaxed_sys(sig_at(peer, EP_SIG_CONSUMED(chan), n.set, p.rank), (n.seq + 1) << 1);
    }
    // The count is next used by this rank's next operation on this set, after this kernel.
    *done = 0;
    if (chan == 0) done[EP_DONE_LANDED - chan] = 0;  // `land_tagged`'s meeting
    // The host's words (read by the host once the kernel completed: no order with the credits
    // needed; nor for block 0's outcome word, as no later operation on this set runs on this
    // rank before this one's verdict was read, its buffer set's lease).
    if (p.masking) st_relaxed_sys(reinterpret_cast<u64*>(p.status) + EP_STATUS_MASK, mask_word(p));
    if (p.verdict && (cancelled | mismatched)) report_failure(p, n, chan, cancelled, mismatched);
    if (p.seq_base) advance_step(p, chan);
    if (p.trace && n.seq % 64 == 0) trace_print(p.rank, chan, n.seq);
}

// The last block to finish returns the credits of this buffer set to every source (after block
// 0's `publish_early`, through `done`).
// `blocks`: the blocks of the grid that take part in the receive (the first ones). An operation
// whose buffer set's next operation has a smaller tag (the 32-bit tag wraps) first clears the
// set's tagged area of its channel (dispatch messages or combine rows), with the whole last
// block (see `sends_tagged` and EP_TAG_TOKENS), whether or not it was tagged itself.
__device__ void finish_receive(const LlParams& p, const OpNum& n, int chan, u32 cancelled, u32 mismatched, u32 absent,
                               int blocks) {
    __syncthreads();
    u64* done = sig_at(reinterpret_cast<u64*>(p.signals), EP_SIG_DONE, n.set, chan);
    if (op_tag(n.seq + (u64)p.num_sets) <= op_tag(n.seq)) {
        __shared__ int last;
        if (threadIdx.x == 0) last = atom_add_acq_rel_gpu(done, 1) == (u64)(blocks - 1);
        __syncthreads();
        if (!last) return;
        char* area = chan == 0 ? tagged_msg(p, p.own_recv, n.set, 0, 0) : tagged_row(p, p.own_recv, n.set, 0);
        const size_t vectors = (chan == 0 ? tagged_dispatch_set_bytes(p) : tagged_combine_set_bytes(p)) / 16;
        for (size_t i = threadIdx.x; i < vectors; i += blockDim.x) st_na_int4(area + i * 16, make_int4(0, 0, 0, 0));
        __syncthreads();  // the clearing before thread 0's release of the credits
        if (threadIdx.x == 0) return_credits(p, n, chan, cancelled, mismatched, absent, done);
        return;
    }
    // The barrier above and the release of the add order every thread's reads and writes of
    // this block before it (the release is cumulative).
    if (threadIdx.x == 0) {
        const bool last = atom_add_acq_rel_gpu(done, 1) == (u64)(blocks - 1);
        trace_at(p, chan, 4);
        if (last) return_credits(p, n, chan, cancelled, mismatched, absent, done);
    }
}

// Block-wide exclusive sum of one count per thread: returns the sum of the counts of the
// threads before this one (in thread order) and sets `*total` to the block's sum. Every thread
// of the block calls it; `warp_sums` holds a word per warp. Callers synchronize the block before
// calling it again (the next call overwrites `warp_sums`).
__device__ __forceinline__ int block_exclusive_sum(int v, int* warp_sums, int* total_shared, int* total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    int incl = v;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
        const int o = __shfl_up_sync(EP_FULL_MASK, incl, d);
        if (lane >= d) incl += o;
    }
    if (lane == 31) warp_sums[warp] = incl;
    __syncthreads();
    if (threadIdx.x == 0) {
        int acc = 0;
        for (int w = 0; w < nwarps; w++) {
            const int c = warp_sums[w];
            warp_sums[w] = acc;
            acc += c;
        }
        *total_shared = acc;
    }
    __syncthreads();
    *total = *total_shared;
    return warp_sums[warp] + incl - v;
}

// Block-wide exclusive scan of one flag per thread: this thread's position among the flagged
// threads of the block, as `block_exclusive_sum` (same calling rules).
__device__ __forceinline__ int block_rank_of_flag(bool flag, int* warp_sums, int* total_shared, int* total) {
    return block_exclusive_sum(flag ? 1 : 0, warp_sums, total_shared, total);
}

// The header words of a received message that the receive reads: the operation number, the
// tagged-rows request and the local expert per top-k entry (16-bit, bytes 16..48, 8 per 16-byte
// load), all loaded together (the header is always readable: no load waits for another's value).
struct MsgHead {
    u64 seq;
    int token;   // the sender's token (a compacted message's slot is not its token)
    int tagged;  // the sender's combine wants tagged rows
    int4 a, b;
};

__device__ __forceinline__ MsgHead load_head(const char* msg, int K) {
    MsgHead h;
    const int4 w = ld_cg_int4(msg);
    h.seq = (u64)(u32)w.x | ((u64)(u32)w.y << 32);
    h.token = w.z;
    h.tagged = w.w;
    h.a = ld_cg_int4(msg + 16);
    h.b = K > 8 ? ld_cg_int4(msg + 32) : make_int4(-1, -1, -1, -1);
    return h;
}

// A tagged message's header words 0..11 (see `load_head`), each 16-byte part once its tags match
// (`await_tags`); false at the deadline.
__device__ __forceinline__ bool load_head_tagged(const char* msg, int K, u32 tag, u64 deadline, MsgHead* h) {
    int4 v[6];
#pragma unroll
    for (int i = 0; i < 6; i++) v[i] = i < 4 || K > 8 ? ld_volatile_int4(msg + 16 * i) : make_int4(0, 0, 0, 0);
    bool ok = await_tags(msg, tag, deadline, &v[0], &v[1]);
    ok = ok && await_tags(msg + 32, tag, deadline, &v[2], &v[3]);
    if (K > 8) ok = ok && await_tags(msg + 64, tag, deadline, &v[4], &v[5]);
    const int4 w = untag(v[0], v[1]);
    h->seq = (u64)(u32)w.x | ((u64)(u32)w.y << 32);
    h->token = w.z;
    h->tagged = w.w;
    h->a = untag(v[2], v[3]);
    h->b = K > 8 ? untag(v[4], v[5]) : make_int4(-1, -1, -1, -1);
    return ok;
}

// The header of source s = slot / M's message for token t = slot % M of this operation, if it
// sent one. `tokens` < 0: a plain dispatch, the slot of the receive region at `recv` (this
// operation's if its number says so). Otherwise a tagged one of `tokens` tokens: every t below
// has a message in the tagged area, waited for; one that never comes is reported (a timeout:
// its source signalled, then stopped) and counts as not sent.
__device__ __forceinline__ bool slot_head(const LlParams& p, const OpNum& n, const char* recv, int slot, int tokens,
                                          u64 deadline, MsgHead* h) {
    if (tokens < 0) {
        *h = load_head(recv + (size_t)slot * p.msg_bytes, p.top_k);
        return h->seq == n.seq + 1;
    }
    const int s = slot / p.max_tokens, t = slot % p.max_tokens;
    if (t >= tokens) return false;
    if (load_head_tagged(tagged_msg(p, p.own_recv, n.set, s, t), p.top_k, op_tag(n.seq), deadline, h)) return true;
    report_lost(p, n, 0, s);
    return false;
}

// The top-k entries of a received message whose rows come back in combine, as bits (bit k:
// entry k): expert-major, every entry naming a local expert; rank-major, the first of them only
// (the slot its rank's pre-reduced row returns in). With `le` >= 0: the entries naming local
// expert `le` instead.
__device__ __forceinline__ u32 head_entries(const MsgHead& h, int K, bool rank_major, int le = -1) {
    const short* la = reinterpret_cast<const short*>(&h.a);
    const short* lb = reinterpret_cast<const short*>(&h.b);
    u32 bits = 0u;
#pragma unroll
    for (int j = 0; j < 8; j++) {
        if (j < K && (le < 0 ? la[j] >= 0 : la[j] == le)) bits |= 1u << j;
        if (j + 8 < K && (le < 0 ? lb[j] >= 0 : lb[j] == le)) bits |= 1u << (j + 8);
    }
    return rank_major ? bits & (0u - bits) : bits;
}

// A forwarded dispatch's received bytes [b0, b0 + bytes) of a plain message's payload into
// output row `out_row`: the part below fwd_token_bytes into `out` (rows of fwd_token_bytes), the
// next fwd_scale_bytes into `out_scales` (rows of fwd_scale_bytes); bytes past both were never
// sent. A warp's call.
__device__ __forceinline__ void forwarded_out(const LlParams& p, const char* payload, size_t out_row, size_t b0,
                                              size_t bytes, int lane) {
    const size_t tb = (size_t)p.fwd_token_bytes, sb = (size_t)p.fwd_scale_bytes, b1 = b0 + bytes;
    const size_t t1 = b1 < tb ? b1 : tb;
    if (b0 < t1) warp_copy_n<4>(reinterpret_cast<char*>(p.out) + out_row * tb + b0, payload + b0, t1 - b0, lane);
    const size_t s0 = b0 > tb ? b0 : tb, s1 = b1 < tb + sb ? b1 : tb + sb;
    if (s0 < s1) {
        warp_copy_n<4>(reinterpret_cast<char*>(p.out_scales) + out_row * sb + (s0 - tb), payload + s0, s1 - s0, lane);
    }
}

// `forwarded_out` from a tagged message's payload (pairs at twice the offsets), each 16 bytes
// once its tags match; false when one never came.
__device__ __forceinline__ bool forwarded_untag(const LlParams& p, const char* payload, size_t out_row, size_t b0,
                                                size_t bytes, int lane, u32 tag, u64 deadline) {
    const size_t tb = (size_t)p.fwd_token_bytes, sb = (size_t)p.fwd_scale_bytes, b1 = b0 + bytes;
    const size_t t1 = b1 < tb ? b1 : tb;
    bool ok = true;
    if (b0 < t1) {
        ok = warp_copy_untag(reinterpret_cast<char*>(p.out) + out_row * tb + b0, payload + 2 * b0, t1 - b0, lane, tag,
                             deadline);
    }
    const size_t s0 = b0 > tb ? b0 : tb, s1 = b1 < tb + sb ? b1 : tb + sb;
    if (ok && s0 < s1) {
        ok = warp_copy_untag(reinterpret_cast<char*>(p.out_scales) + out_row * sb + (s0 - tb), payload + 2 * s0,
                             s1 - s0, lane, tag, deadline);
    }
    return ok;
}

// The tagged counterpart of a received row's copy in `dispatch_recv`: piece `part` (of `piece`
// plain bytes) of source s = slot / M's tagged message for token t = slot % M into output row
// `out_row`, and with part 0 the rank-major weights and local experts and the FP8 scales, each
// word once its tags match. False when one never came (reported: its source stopped mid-send).
// FWD: a forwarded dispatch's (`forwarded_untag`).
template <bool FWD>
__device__ __forceinline__ bool copy_tagged_piece(const LlParams& p, const OpNum& n, int slot, size_t out_row, int part,
                                                  size_t piece, int lane, u64 deadline) {
    const u32 tag = op_tag(n.seq);
    const int K = p.top_k, H = p.hidden, s = slot / p.max_tokens;
    const char* msg = tagged_msg(p, p.own_recv, n.set, s, slot % p.max_tokens);
    const size_t payload_bytes = p.fp8 ? (size_t)H : (size_t)H * 2;
    // The part-0 warp's header words (rank-major weights and local experts) and FP8 scales
    // (two per lane; more come after) are loaded before the payload and awaited after it: their
    // round trips overlap the payload's instead of preceding or following it.
    const bool head = p.rank_major && part == 0 && lane < K;
    const char* w_at = msg + 2 * (EP_HDR_WEIGHTS + 4 * lane);
    const char* le_at = msg + 2 * (16 + 4 * (lane / 2));
    uint2 w = make_uint2(0u, 0u), le = w;
    if (head) {
        w = ld_tagged_pair(w_at);
        le = ld_tagged_pair(le_at);
    }
    const char* payload = msg + 2 * EP_HDR_BYTES;
    const int cols = H / 128;
    const bool scales = p.fp8 && part == 0;
    uint2 s0 = make_uint2(0u, 0u), s1 = s0;
    if (scales && lane < cols) s0 = ld_tagged_pair(payload + 2 * (H + 4 * lane));
    if (scales && lane + 32 < cols) s1 = ld_tagged_pair(payload + 2 * (H + 4 * (lane + 32)));
    bool ok = FWD ? forwarded_untag(p, payload, out_row, part * piece, piece, lane, tag, deadline)
                  : warp_copy_untag(reinterpret_cast<char*>(p.out) + out_row * payload_bytes + part * piece,
                                    payload + 2 * part * piece, piece, lane, tag, deadline);
    if (head) {
        ok = ok && await_word(w_at, tag, deadline, &w) && await_word(le_at, tag, deadline, &le);
        reinterpret_cast<float*>(p.out_weights)[out_row * K + lane] = __uint_as_float(w.x);
        const u32 half = (lane & 1) ? le.x >> 16 : le.x;
        reinterpret_cast<int*>(p.out_idx)[out_row * K + lane] = (int)(short)(unsigned short)half;
    }
    if (scales) {
        float* dst = reinterpret_cast<float*>(p.out_scales) + out_row * cols;
        if (lane < cols) {
            ok = ok && await_word(payload + 2 * (H + 4 * lane), tag, deadline, &s0);
            dst[lane] = __uint_as_float(s0.x);
        }
        if (lane + 32 < cols) {
            ok = ok && await_word(payload + 2 * (H + 4 * (lane + 32)), tag, deadline, &s1);
            dst[lane + 32] = __uint_as_float(s1.x);
        }
        for (int c = lane + 64; ok && c < cols; c += 32) {
            uint2 v = ld_tagged_pair(payload + 2 * (H + 4 * c));
            ok = await_word(payload + 2 * (H + 4 * c), tag, deadline, &v);
            dst[c] = __uint_as_float(v.x);
        }
    }
    if (!ok) report_lost(p, n, 0, s);
    return ok;
}

// Piece `part` (of `piece` bytes) of the plain message `msg`'s payload into output row `out_row`;
// with part 0 also the rank-major weights and local experts and the FP8 scales, loaded before
// the payload's copy and stored after it, so their latency overlaps the copy's instead of
// adding to it. A warp's call (all lanes). FWD: a forwarded dispatch's (`forwarded_out`).
template <bool FWD>
__device__ __forceinline__ void copy_plain_piece(const LlParams& p, const char* msg, size_t out_row, int part,
                                                 size_t piece, int lane) {
    const int K = p.top_k, H = p.hidden;
    const size_t payload_bytes = p.fp8 ? (size_t)H : (size_t)H * 2;
    const char* payload = msg + EP_HDR_BYTES;
    const bool head = p.rank_major && part == 0 && lane < K;
    float w = 0.f;
    int le = -1;
    if (head) {
        w = __ldcg(reinterpret_cast<const float*>(msg + EP_HDR_WEIGHTS) + lane);
        le = (int)__ldcg(reinterpret_cast<const short*>(msg + 16) + lane);
    }
    const int cols = H / 128;
    const bool scales_here = p.fp8 && part == 0;
    const float* ssrc = reinterpret_cast<const float*>(payload + H);
    float s0 = 0.f, s1 = 0.f;
    if (scales_here) {
        if (lane < cols) s0 = __ldcg(ssrc + lane);
        if (lane + 32 < cols) s1 = __ldcg(ssrc + lane + 32);
    }
    if (FWD) {
        forwarded_out(p, payload, out_row, part * piece, piece, lane);
    } else {
        warp_copy_n<4>(reinterpret_cast<char*>(p.out) + out_row * payload_bytes + part * piece, payload + part * piece,
                       piece, lane);
    }
    if (head) {
        reinterpret_cast<float*>(p.out_weights)[out_row * K + lane] = w;
        reinterpret_cast<int*>(p.out_idx)[out_row * K + lane] = le;
    }
    if (scales_here) {
        float* dst = reinterpret_cast<float*>(p.out_scales) + out_row * cols;
        if (lane < cols) dst[lane] = s0;
        if (lane + 32 < cols) dst[lane + 32] = s1;
        for (int c = lane + 64; c < cols; c += 32) dst[c] = __ldcg(ssrc + c);
    }
}

// The receive's work once every source arrived (see `dispatch_recv`). TAGGED: some source sent
// tagged messages (`tagged_tokens[s]` >= 0): their headers and payloads are read from the tagged
// area as their tags say they came; `skip`: the sources whose data is not taken; `compact`: per
// source, its compacted rank-major messages (slot i is output row i: no header is read before
// the copies), or -1. FWD: a forwarded dispatch's.
template <bool TAGGED, bool FWD>
__device__ __forceinline__ void dispatch_recv_tasks(const LlParams& p, const OpNum& n, u32 skip,
                                                    const int* tagged_tokens, const int* compact, u64 tag_deadline,
                                                    int* warp_sums, int* entry_slot) {
    int& total_shared = warp_sums[16];
    const int G = p.splits;
    const int R = p.num_ranks, M = p.max_tokens, K = p.top_k, H = p.hidden;
    const int RM = R * M;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    const char* recv = reinterpret_cast<const char*>(p.own_recv) + (size_t)n.set * p.recv_set_bytes;
    int* row_of = reinterpret_cast<int*>(p.row_of);
    const size_t payload_bytes = p.fp8 ? (size_t)H : (size_t)H * 2;
    const bool rm = p.rank_major != 0;
    const int Q = rm ? R : p.num_local;
    // A grid smaller than Q * G loops (max_sms).
    for (int task = blockIdx.x; task < Q * G; task += gridDim.x) {
    const int q = task / G, g = task % G;
    const int le = rm ? -1 : q;
    // Rank-major, source q's messages compacted: its rows are its first slots, in order (no
    // header read, no scan; the return list's block writes their row map).
    const bool packed = rm && compact[q] >= 0;
    const int first_slot = rm ? q * M : 0;
    const int span = packed ? (((skip >> q) & 1u) ? 0 : compact[q]) : rm ? M : RM;
    const size_t group_base = rm ? (size_t)q * M : (size_t)q * RM;  // output row of the group's row 0
    int base = 0;
    for (int chunk = 0; chunk < span; chunk += blockDim.x) {
        int chunk_total;
        if (packed) {
            chunk_total = min(span - chunk, (int)blockDim.x);
        } else {
            const int slot = first_slot + chunk + threadIdx.x;
            int k_sel = -1;
            if (chunk + (int)threadIdx.x < span) {
                const int s = slot / M;
                MsgHead h;
                // A skipped source's tagged messages are not waited for (a cancelled one sends none).
                const bool skipped = (skip >> s) & 1u;
                const int tokens = TAGGED && !skipped ? tagged_tokens[s] : -1;
                const bool sent = slot_head(p, n, recv, slot, tokens, tag_deadline, &h);
                if (!skipped && sent) {
                    // Rank-major: the slot's first local entry; expert-major: the entry naming
                    // expert `le` (top-k entries name distinct experts).
                    k_sel = __ffs(head_entries(h, K, rm, le)) - 1;
                }
            }
            const int pos = block_rank_of_flag(k_sel >= 0, warp_sums, &total_shared, &chunk_total);
            if (k_sel >= 0) {
                entry_slot[pos] = slot;
                if (g == 0) row_of[(size_t)slot * K + k_sel] = (int)group_base + base + pos;
            }
            __syncthreads();
        }
        // Rows with row % G == g are this block's: e0, e0 + G, ... of the chunk. Each is copied
        // in `recv_chunks` pieces, and the block's (row, piece) items are dealt out to its warps
        // in turn (not every item of the chunk, skipping others' rows: that left all of a block's
        // rows to a few warps, one after another; 9 us at 128 tokens, benches/NOTES.md item 68).
        const int C = p.recv_chunks;
        const size_t piece = payload_bytes / C;
        const int e0 = ((g - base % G) % G + G) % G;
        const int mine = e0 < chunk_total ? (chunk_total - 1 - e0) / G + 1 : 0;
        for (int item = warp; item < mine * C; item += nwarps) {
            const int e = e0 + (item / C) * G, part = item % C;
            const int row = base + e;
            const int slot = packed ? first_slot + row : entry_slot[e];
            const size_t out_row = group_base + row;
            if (TAGGED && tagged_tokens[slot / M] >= 0) {
                copy_tagged_piece<FWD>(p, n, slot, out_row, part, piece, lane, tag_deadline);
                continue;
            }
            copy_plain_piece<FWD>(p, recv + (size_t)slot * p.msg_bytes, out_row, part, piece, lane);
        }
        base += chunk_total;
        __syncthreads();
    }
    // Rank-major: source q's rows after its last received one carry no expert (-1 in every
    // top-k entry), so a caller reading past a source's count sees sentinels, not a stale
    // dispatch's ids (NCCL EP's contract since nccl-extensions' recv_topk_idx_flags test).
    if (rm && g == 0) {
        int* idx = reinterpret_cast<int*>(p.out_idx) + (size_t)q * M * K;
        for (int e = base * K + (int)threadIdx.x; e < M * K; e += blockDim.x) idx[e] = -1;
    }
    if (g == 0 && threadIdx.x == 0) {
        reinterpret_cast<int*>(p.out_counts)[q] = base;
        if (p.host_counts) reinterpret_cast<volatile int*>(p.host_counts)[q] = base;
    }
    __syncthreads();
    }
    // One block marks every (source, token, k) whose row does not come back in combine: a slot
    // of this operation that did not arrive, or an entry naming no local expert (rank-major:
    // every k but the first local one, whose slot the row returns in). A thread per slot; the
    // entries that do come back go, in (token, k) order, into their source's part of the return
    // list (`ret_list`), and their number into `ret_count`. The grid's last block when it has no
    // task above (so this runs beside the copies, not after block 0's), else block 0. A source
    // whose messages sit compacted has its slot i in output row i and its token in the header:
    // every (token, k) of it is first marked as not coming back, then its rows set theirs (this
    // block writes its whole row map; the copies above do not).
    if ((int)blockIdx.x == ((int)gridDim.x > Q * G ? (int)gridDim.x - 1 : 0)) {
        __shared__ int src_start[EP_MAX_RANKS + 1];
        __shared__ int src_tagged[EP_MAX_RANKS];
        if ((int)threadIdx.x < R) src_tagged[threadIdx.x] = 0;
        for (int e = threadIdx.x; e < RM * K; e += blockDim.x) {
            if (compact[e / (M * K)] >= 0) row_of[e] = -1;
        }
        __syncthreads();
        int* list = reinterpret_cast<int*>(p.ret_list);
        int base = 0;
        for (int chunk = 0; chunk < RM; chunk += blockDim.x) {
            const int slot = chunk + threadIdx.x;
            u32 back = 0u;
            int token = slot % M;
            if (slot < RM) {
                const int s = slot / M;
                const bool packed = compact[s] >= 0;
                MsgHead h;
                bool valid = false;
                if ((skip >> s) & 1u) {
                    valid = false;
                } else if (packed) {
                    valid = slot % M < compact[s];
                    if (valid && TAGGED && tagged_tokens[s] >= 0) {
                        valid = slot_head(p, n, recv, slot, tagged_tokens[s], tag_deadline, &h);
                    } else if (valid) {
                        h = load_head(recv + (size_t)slot * p.msg_bytes, K);
                    }
                    valid = valid && h.token >= 0 && h.token < M;
                } else {
                    valid = slot_head(p, n, recv, slot, TAGGED ? tagged_tokens[s] : -1, tag_deadline, &h);
                }
                back = valid ? head_entries(h, K, rm) : 0u;
                if (valid && h.tagged == 1) src_tagged[s] = 1;  // every such slot agrees
                if (packed) {
                    token = valid ? h.token : 0;
                    if (back != 0u) row_of[((size_t)s * M + token) * K + __ffs(back) - 1] = slot;
                } else {
                    for (int k = 0; k < K; k++) {
                        if (!((back >> k) & 1u)) row_of[(size_t)slot * K + k] = -1;
                    }
                }
            }
            int chunk_total;
            int pos = base + block_exclusive_sum(__popc(back), warp_sums, &total_shared, &chunk_total);
            // The first slot of each source records where the source starts in the block's
            // numbering (this chunk or an earlier one: slots come in order).
            if (slot < RM && slot % M == 0) src_start[slot / M] = pos;
            __syncthreads();
            if (slot < RM) {
                const int s = slot / M;
                int* at = list + (size_t)s * M * K + (pos - src_start[s]);
                const int t_k = token * K;
                for (u32 b = back; b != 0u; b &= b - 1u) *at++ = t_k + __ffs(b) - 1;
            }
            base += chunk_total;
            __syncthreads();
        }
        if ((int)threadIdx.x < R) {
            const int s = threadIdx.x;
            reinterpret_cast<int*>(p.ret_count)[s] =
                ((s + 1 < R ? src_start[s + 1] : base) - src_start[s]) | (src_tagged[s] ? EP_RET_TAGGED : 0);
        }
    }
    // The last block numbers, per NCCL source, its (token, k) rows in ascending order: the order
    // combine packs them in, and the one the source expects (nccl.rs).
    if (blockIdx.x == gridDim.x - 1 && p.nccl_mask) {
        int* pack = reinterpret_cast<int*>(p.nccl_pack);
        const int MK = M * K;
        for (int s = 0; s < R; s++) {
            if (!via_nccl(p, s)) continue;
            const bool src_ok = !((skip >> s) & 1u);
            int base = 0;
            for (int chunk = 0; chunk < MK; chunk += blockDim.x) {
                const int i = chunk + threadIdx.x;
                bool sel = false;
                if (i < MK && src_ok) {
                    const MsgHead h = load_head(recv + ((size_t)s * M + i / K) * p.msg_bytes, K);
                    sel = h.seq == n.seq + 1 && ((head_entries(h, K, rm) >> (i % K)) & 1u);
                }
                int chunk_total;
                const int pos = block_rank_of_flag(sel, warp_sums, &total_shared, &chunk_total);
                if (i < MK) pack[(size_t)s * MK + i] = sel ? base + pos : -1;
                base += chunk_total;
                __syncthreads();
            }
            if (threadIdx.x == 0) reinterpret_cast<volatile int*>(p.nccl_counts)[s] = base;
        }
    }
}

// Task (group q, split g) of Q * splits (each block takes tasks blockIdx, blockIdx + gridDim, ...).
// Expert-major: q is local expert l; the task finds, in (source, token) order, the received
// slots that chose l and packs them into rows 0.. of expert l. Rank-major: q is source s; the
// task packs s's valid slots, in token order, into rows s*M.., with their weights and local
// expert indices. Rows with row % splits == g are copied by this block; split 0 writes the
// counters and the row map for combine.
//
// The plain one-launch dispatch kernel's way with tagged sources (a peer sent tagged, this rank
// plain: rare, and the plain path must keep its registers): every block copies its share of the
// tagged messages into their plain slots, as the source would have written them (the header,
// and the payload of a token routed here), each 16 bytes once its tags match; then the grid meets
// (every block of a one-launch kernel is resident; the count is reset with the credits) and the
// plain tasks run. Items are (source, token, quarter of the payload), a warp each. A message
// or a block that never comes is reported at the deadline.
__device__ void land_tagged(const LlParams& p, const OpNum& n, u32 skip, const int* tagged_tokens, u64 deadline) {
    const int lane = threadIdx.x & 31, nwarps = blockDim.x >> 5, K = p.top_k, M = p.max_tokens;
    const u32 tag = op_tag(n.seq);
    // The payload bytes the sender wrote (a forwarded row's: its token and scale bytes only).
    const size_t vecs = (p.fwd_token_bytes ? (size_t)p.fwd_token_bytes + p.fwd_scale_bytes
                         : p.fp8          ? (size_t)p.hidden + 4 * (p.hidden / 128)
                                          : (size_t)p.hidden * 2) /
                        16;
    const int units = p.rank_major ? 7 : 3;  // 16-byte units of the header the sender wrote
    char* recv = reinterpret_cast<char*>(p.own_recv) + (size_t)n.set * p.recv_set_bytes;
    bool ok = true;
    int s = 0;  // the source whose message did not come, once !ok
    for (; s < p.num_ranks; s++) {
        const int tokens = tagged_tokens[s];
        if (tokens < 0 || ((skip >> s) & 1u)) continue;
        const int first = blockIdx.x * nwarps + (threadIdx.x >> 5);
        for (int item = first; ok && item < tokens * 4; item += gridDim.x * nwarps) {
            const int t = item / 4, q = item % 4;
            const char* msg = tagged_msg(p, p.own_recv, n.set, s, t);
            char* plain = recv + ((size_t)s * M + t) * p.msg_bytes;
            int4 lo = make_int4(0, 0, 0, 0), hi = lo;
            if (lane < units) {
                lo = ld_volatile_int4(msg + 32 * lane);
                hi = ld_volatile_int4(msg + 32 * lane + 16);
                ok = await_tags(msg + 32 * lane, tag, deadline, &lo, &hi);
            }
            const int4 v = untag(lo, hi);
            if (q == 0 && lane < units && ok) st_na_int4(plain + 16 * lane, v);
            // Lanes 1 and 2 hold the local expert of entries 0..7 and 8..15.
            const short* le = reinterpret_cast<const short*>(&v);
            bool mine = false;
            for (int j = 0; j < 8; j++) mine |= (lane == 1 || lane == 2) && (lane - 1) * 8 + j < K && le[j] >= 0;
            ok = __all_sync(EP_FULL_MASK, ok);
            if (!ok || !__any_sync(EP_FULL_MASK, mine)) continue;
            const size_t v0 = vecs * q / 4, v1 = vecs * (q + 1) / 4;
            ok = warp_copy_untag(plain + EP_HDR_BYTES + v0 * 16, msg + 2 * EP_HDR_BYTES + v0 * 32, (v1 - v0) * 16,
                                 lane, tag, deadline);
            ok = __all_sync(EP_FULL_MASK, ok);
        }
        if (!ok) break;
    }
    if (!ok && lane == 0) {
        report_lost(p, n, 0, s);
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        // A block that gave up on a message (reported above) still comes; this wait ends at the
        // deadline only if one of this grid's blocks gave up before the receive.
        u64* met = sig_at(reinterpret_cast<u64*>(p.signals), EP_SIG_DONE, n.set, EP_DONE_LANDED);
        atom_add_acq_rel_gpu(met, 1);
        while (ld_acquire_sys(met) < (u64)gridDim.x) {
            if (globaltimer_ns() > deadline) {
                report_lost(p, n, 0, p.rank);
                break;
            }
        }
    }
    __syncthreads();
}

// The receive reads tagged sources' messages (`sends_tagged`) through `dispatch_recv_tasks<true>`,
// compiled beside the plain `<false>`, which the operations without them run. LAND (the plain
// one-launch kernel): tagged messages are first copied into their plain slots (`land_tagged`),
// then `<false>` runs, so that kernel carries no tagged task loop (with it, inlined or called,
// expert-major 128-token dispatches took 2-4 us longer; with `land_tagged` 1-2 us, benches/NOTES.md
// item 75). TAGGED_ONLY (the tagged one-launch kernel, whose rank sends at a few tokens): only
// `<true>`, which takes plain sources too, so that kernel carries one task loop, not two. FWD: a
// forwarded dispatch's kernels (`LlParams::fwd_token_bytes`).
template <bool FWD, bool LAND, bool TAGGED_ONLY = false>
__device__ __forceinline__ void dispatch_recv(const LlParams& p, const OpNum& n) {
    __shared__ u32 cancelled, mismatched, absent;
    __shared__ int timed_out;
    __shared__ int tagged_tokens[EP_MAX_RANKS];  // per source: the tokens of a tagged dispatch, or -1
    __shared__ int compact[EP_MAX_RANKS];        // per source: its compacted rank-major messages, or -1
    __shared__ u64 tag_deadline;                 // the waits for tagged messages give up then
    __shared__ int warp_sums[17];                // a word per warp, then the block's total (block scans)
    __shared__ int entry_slot[512];
    // Two timeouts from now: the arrivals' wait, then the tagged messages' (the deadline is set
    // before the wait so that no load or barrier follows it).
    if (threadIdx.x == 0) tag_deadline = globaltimer_ns() + 2 * p.timeout_ns;
    if (!ll_wait_all_sources(p, n, 0, &cancelled, &mismatched, &timed_out, &absent, tagged_tokens, compact)) return;
    publish_early(p, n, 0, cancelled, mismatched, absent);
    trace_at(p, 0, 2);
    // A cancelled operation only consumes what arrived: it writes neither the outputs (their
    // buffer set may still hold a live result) nor the handle's row map. Nor does one of a rank
    // the group masked (its host reports `RankMasked`).
    if (p.cancelled || ((absent >> p.rank) & 1u)) {
        finish_receive(p, n, 0, cancelled, mismatched, absent, gridDim.x);
        return;
    }
    const u32 skip = cancelled | mismatched | absent;
    bool any_tagged = false;
    for (int s = 0; s < p.num_ranks; s++) any_tagged |= tagged_tokens[s] >= 0 && !((skip >> s) & 1u);
    if (any_tagged && LAND) land_tagged(p, n, skip, tagged_tokens, tag_deadline);
    if (TAGGED_ONLY || (any_tagged && !LAND)) {
        dispatch_recv_tasks<true, FWD>(p, n, skip, tagged_tokens, compact, tag_deadline, warp_sums, entry_slot);
    } else {
        dispatch_recv_tasks<false, FWD>(p, n, skip, tagged_tokens, compact, tag_deadline, warp_sums, entry_slot);
    }
    trace_at(p, 0, 3);
    finish_receive(p, n, 0, cancelled, mismatched, absent, gridDim.x);
}

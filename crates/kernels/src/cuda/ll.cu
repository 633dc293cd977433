// epflow low-latency dispatch and combine: a send half and a complete half, launched as two
// kernels (staged operations) or as one (the synchronous form; see the kernels at the end).
//
// Dispatch message (one per token and destination rank), in the receiver's region for this
// sender, slot = token index:  [u64 seq+1][i32 token][i32 1: the sender's combine wants tagged
// rows (`wants_tagged`), else 0][i16 local expert per k, -1 if the
// k-th expert is elsewhere (bytes 16..48)][rank-major: f32 weight per k (bytes 48..112)][pad to
// 128 B][payload: BF16 row, or FP8 row + fp32 scales]. Tagged (a dispatch of at most
// EP_TAG_TOKENS tokens, `sends_tagged`): the same message with each 4-byte word as an 8-byte
// pair {word, tag}, in the receiver's tagged dispatch area at [sender][token], one for every
// token (a token routed elsewhere sends only its header, every local expert -1).
// Combine message (one per token and expert; rank-major: one per token and rank reached, in the
// slot of the rank's first top-k entry): the BF16 row, in the source rank's region at [token][k];
// or, tagged (see EP_TAG_TOKENS), in the source rank's tagged area at [token][sending rank]
// (rank-major) or [token][k] (expert-major).
//
// Layouts (epflow_core::ops::Layout): expert-major packs a row per (token, local expert) into
// [L x R*M x H]; rank-major packs a row per (source, token) into [R*M x H] with the weights and
// local expert indices [R*M x K], and its combine adds the pre-reduced rows with weight 1.

struct LlParams {
    // Pointers (device addresses; host_counts and status are mapped host memory).
    u64 x;            // dispatch: tokens [B x H] BF16
    u64 topk_idx;     // [B x K] int64 (the handle's copy)
    u64 weights;      // combine: [B x K] fp32
    u64 row_of;       // [R x M x K] int32: expert-output row of each received (source, token, k)
    u64 out;          // dispatch: [L x R*M x H]; combine: [B x H] BF16
    u64 out_scales;   // dispatch FP8: [L x R*M x H/128] fp32
    u64 out_counts;   // dispatch: [L] int32 (device)
    u64 host_counts;  // dispatch: [L] int32 (mapped host) or 0
    u64 expert_out;   // combine: [L x R*M x H] BF16
    u64 signals;      // this rank's signal page
    u64 status;       // this rank's status page (mapped host)
    u64 own_recv;     // this rank's receive region of this channel
    u64 peer_recv[EP_MAX_RANKS];     // every rank's receive region of this channel
    u64 peer_signals[EP_MAX_RANKS];  // every rank's signal page
    u64 seq;          // operation number on this channel
    u64 timeout_ns;
    u64 recv_set_bytes;  // bytes of one buffer set of the receive region
    u64 msg_bytes;       // dispatch message bytes
    int rank, num_ranks, max_tokens, hidden;
    int top_k, num_local, num_tokens, set;
    int num_sets, fp8, round_scales, cancelled;
    int splits, chunks, nccl_mask, rank_major;
    // Ranks in `nccl_mask` are reached through NCCL (nccl.rs), not NVLink: the send kernels write
    // their messages into local staging (`nccl_out` + dest * `nccl_dest_bytes`), skip their
    // credits, and NCCL carries the staging and the arrival word after the kernel.
    u64 nccl_out;
    u64 nccl_in;          // combine: the packed rows NCCL delivered, [rows x H] BF16
    u64 nccl_pack;        // [R x M x K] int32: combine row index in the staging for that source, or -1
    u64 nccl_counts;      // dispatch: [R] int32 (mapped host): rows each NCCL source gets back in combine
    u64 nccl_pos;         // combine: [M x K] int32: row of (t, k) in `nccl_in`, or -1 (arrived over NVLink)
    u64 nccl_dest_bytes;  // staging bytes per destination
    u64 stamp;            // what every rank must agree on (epflow_core::stamp), checked per source
    u64 out_weights;      // rank-major dispatch: [R*M x K] fp32 received weights
    u64 out_idx;          // rank-major dispatch: [R*M x K] int32 local expert per top-k entry, or -1
    int recv_chunks;      // complete half: pieces a received row is copied (dispatch) or summed (combine) in
    int masking;          // 1: rank masking (epflow_core::mask): a peer that misses the deadline is masked
    // Operations captured in a CUDA graph (graph/ in epflow-kernels): the operation number is
    // `seq` (the operation's place on its channel within the captured step) plus the channel's
    // base, the u64 at `seq_base` in device memory, read when the kernel starts (the step advances
    // it after every replay); `set` follows from it. 0 for operations the host numbers.
    u64 seq_base;
    u64 verdict;          // captured: the step's failure word (mapped host), or 0 (see `report_failure`)
    u64 topk_src;         // captured dispatch: the caller's [B x K] int64 top-k buffer (see `routed_entry`), or 0
    u64 route_report;     // captured dispatch: the handle's report of invalid rows (mapped host)
    u64 masked_out;       // combine with masking: [B] int32, per token its top-k entries on absent ranks, or 0
    // The handle's return list (written by one block of the dispatch receive, read by the
    // combine send): per source s, in (token, k) order, the entries t * K + k whose rows come back, at
    // ret_list[s * M * K ..][0 .. ret_count[s]] (a fixed place per source, so a combine warp
    // loads its first entry without waiting for the count); combine's warps share out only real
    // rows.
    u64 ret_list;         // [R x M x K] int32
    u64 ret_count;        // [R] int32
    int trace;            // 1: `EPFLOW_LL_TRACE` (see `trace_at`)
    int tag_tokens;       // most tokens of a combine that takes tagged rows (0: none; see `wants_tagged`, EP_TAG_TOKENS)
    int tag_dispatch_tokens;  // most tokens of a dispatch sent as tagged messages (0: none; see `sends_tagged`)
};
// The Rust mirror (epflow-kernels params.rs) must agree byte for byte.
static_assert(sizeof(LlParams) == 472, "LlParams layout");

// The number and buffer set of the operation a launch runs: the host's, or for a captured
// operation its offset plus the step's base in device memory (written by an earlier kernel of the
// stream: the previous replay's advance, or a rebase). `dead`: a captured operation of a step
// that already timed out on this rank (it does nothing, so a failed replay ends at once).
struct OpNum {
    u64 seq;
    int set;
    bool dead;
};

// The step's bases are [dispatch, combine, replay, failed, dispatches, combines, last] (see
// `advance_step`); `seq_base` points at the channel's.
__device__ __forceinline__ u64* step_failed_flag(const LlParams& p, int chan) {
    return reinterpret_cast<u64*>(p.seq_base) - chan + 3;
}

__device__ __forceinline__ OpNum op_num(const LlParams& p, int chan) {
    if (!p.seq_base) return OpNum{p.seq, p.set, false};
    const u64 seq = p.seq + __ldcg(reinterpret_cast<const u64*>(p.seq_base));
    return OpNum{seq, (int)(seq % (u64)p.num_sets), __ldcg(step_failed_flag(p, chan)) != 0};
}

// `EPFLOW_LL_TRACE=1` (a diagnostic, off by default): block 0's thread 0 stamps the global
// timer at the kernel's entry (0), after its send part (1), once every source arrived (2) and
// when its receive work is done (3), per channel; the last block to finish prints them every
// 64th operation, relative to the entry (of the send kernel, in the two-launch form), with the
// end after the credits. One set of stamps per GPU (a module global): ranks sharing a GPU mix.
__device__ u64 ep_ll_trace[2][4];

__device__ __forceinline__ void trace_at(const LlParams& p, int chan, int i) {
    if (p.trace && blockIdx.x == 0 && threadIdx.x == 0) ep_ll_trace[chan][i] = globaltimer_ns();
}

// The last block's report of the stamps (out of line: the printf's frame stays off the kernels).
__device__ __noinline__ void trace_print(int rank, int chan, u64 seq) {
    const u64 end = globaltimer_ns();
    const volatile u64* t = ep_ll_trace[chan];
    const u64 t0 = t[0];
    printf("EPFLOW_LL_TRACE rank %d %s seq %llu: entry at %.2f us (global timer mod 1 s: compare ranks), block 0 "
           "sent %.2f, all arrived %.2f, received %.2f, end %.2f us after the entry\n",
           rank, chan == 0 ? "dispatch" : "combine", (unsigned long long)seq, (double)(t0 % 1000000000ull) * 1e-3,
           (t[1] - t0) * 1e-3, (t[2] - t0) * 1e-3, (t[3] - t0) * 1e-3, (end - t0) * 1e-3);
}

// A captured operation timed out: the step's later operations on this rank skip their work.
__device__ __forceinline__ void mark_step_failed(const LlParams& p, int chan) {
    if (p.seq_base) atomicExch(step_failed_flag(p, chan), 1ull);
}

// Tagged data (a dispatch message, a combine row, or a block of `land_tagged`'s meeting) that
// never came by the deadline, from `src`: reported like a missing arrival, the captured step
// marked failed.
__device__ __forceinline__ void report_lost(const LlParams& p, const OpNum& n, int chan, int src) {
    report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_ARRIVAL, src, n.seq);
    mark_step_failed(p, chan);
}

__device__ __forceinline__ bool via_nccl(const LlParams& p, int r) { return (p.nccl_mask >> r) & 1; }

// Rank masking (epflow_core::mask): this rank's mask word (0 without masking).
__device__ __forceinline__ u64 mask_word(const LlParams& p) {
    return p.masking ? ld_acquire_sys(mask_area(reinterpret_cast<u64*>(p.signals))) : 0ull;
}

// Whether mask word `m` masks rank `a` or rank `b` (a pair that exchanges nothing).
__device__ __forceinline__ bool either_masked(u64 m, int a, int b) { return ((m >> a) | (m >> b)) & 1ull; }

// ORs `bits` into this rank's mask word, then into every peer's (the masked ranks' own included,
// so they learn it), and mirrors this rank's word in its status page for its host.
__device__ void mask_everywhere(u64 signals, const u64* peer_signals, u64 status, int rank, int num_ranks, u64 bits) {
    u64* own = mask_area(reinterpret_cast<u64*>(signals));
    atomicOr(own, bits);
    for (int r = 0; r < num_ranks; r++) {
        if (r != rank) atomicOr_system(mask_area(reinterpret_cast<u64*>(peer_signals[r])), bits);
    }
    __threadfence_system();
    st_relaxed_sys(reinterpret_cast<u64*>(status) + EP_STATUS_MASK, ld_acquire_sys(own));
}

// This rank gave up on the ranks of `bits`: masks them everywhere, unless this rank finds itself
// masked — then it masks no one (a slow rank never masks the survivors that gave up on it).
__device__ void spread_mask(const LlParams& p, u64 bits) {
    if ((ld_acquire_sys(mask_area(reinterpret_cast<u64*>(p.signals))) >> p.rank) & 1ull) return;
    mask_everywhere(p.signals, p.peer_signals, p.status, p.rank, p.num_ranks, bits);
}

// Waits (lane 0) for destination `dest`'s credit for this operation's set. With masking it stops
// when `dest` is masked (by a peer, or here at the deadline) and returns true: skip `dest`.
__device__ bool wait_credit(const LlParams& p, const OpNum& n, int chan, int dest) {
    if (n.seq < (u64)p.num_sets || via_nccl(p, dest)) return false;
    const u64* c = sig_at(reinterpret_cast<u64*>(p.signals), EP_SIG_CONSUMED(chan), n.set, dest);
    const u64 want = n.seq + 1 - p.num_sets;
    const u64 deadline = globaltimer_ns() + p.timeout_ns;
    while ((ld_acquire_sys(c) >> 1) < want) {
        if ((mask_word(p) >> dest) & 1ull) return true;
        if (globaltimer_ns() > deadline) {
            if (p.masking) {
                spread_mask(p, 1ull << dest);
                return true;
            }
            report_error(reinterpret_cast<u64*>(p.status), EP_ERR_TIMEOUT_CREDIT, dest, n.seq);
            mark_step_failed(p, chan);
            return false;
        }
    }
    return false;
}

#define EP_HDR_WEIGHTS 48  // byte offset of the rank-major weights in a dispatch message header

// Tagged combine rows (flags in the payload). A token owner whose combine's rows fit its tagged
// area (`wants_tagged`: rank-major, at most `tag_tokens` tokens; expert-major, at most
// `tag_tokens` x R rows of K per token) and that reaches no peer through NCCL asks for its rows
// back tagged, in word 3 of each dispatch message: the expert side then sends each row as 8-byte
// pairs {two BF16 channels, the operation's tag} into the owner's tagged area, and signals its
// arrival at once, before the payload: no system-scope fence, no count of its warps, no release
// after the payload (about 3 us of a 1-token combine's send, benches/NOTES.md items 69 and 72).
// The receiver takes a pair once its tag matches, and clears what it read before it returns its
// credits, so the area only ever holds zeros and the rows of the operation in flight: no stale
// pair can carry a matching tag. Twice the bytes over NVLink: at more tokens the fenced form is
// faster. The area after every set's plain region holds min(EP_TAG_TOKENS, M) x R rows of 4 H
// bytes per set (epflow-kernels layout.rs): rank-major row t * R + r (token t, sending rank r),
// expert-major row t * K + k. Rank masking sets `tag_tokens` to 0.
#define EP_TAG_TOKENS 32
#define EP_RET_TAGGED (1 << 30)  // `ret_count` bit: the source asked for tagged rows

// Whether this rank's operations on this handle use tagged combine rows (the token owner's
// choice: its dispatch sends ask for them, its combine receive reads them).
__device__ __forceinline__ bool wants_tagged(const LlParams& p) {
    if (p.nccl_mask != 0 || p.tag_tokens <= 0) return false;
    return p.rank_major ? p.num_tokens <= p.tag_tokens : p.num_tokens * p.top_k <= p.tag_tokens * p.num_ranks;
}

// The tag of operation `seq` (never 0: the cleared area's value).
__device__ __forceinline__ u32 op_tag(u64 seq) {
    const u32 t = (u32)(seq + 1);
    return t ? t : 1u;
}

// Tagged row `row` (rank-major t * R + r, expert-major t * K + k) of buffer set `set` in the
// combine receive region at `region` (after every set's plain part of `recv_set_bytes`).
__device__ __forceinline__ char* tagged_row(const LlParams& p, u64 region, int set, int row) {
    const size_t bytes = (size_t)p.hidden * 4, cap = (size_t)min(EP_TAG_TOKENS, p.max_tokens);
    return reinterpret_cast<char*>(region) + (size_t)p.num_sets * p.recv_set_bytes +
           ((size_t)set * cap * p.num_ranks + row) * bytes;
}

// Copies `bytes` (a multiple of 16) of BF16 channels with one warp as tagged pairs (2 x `bytes`
// at `dst`), 2 source vectors in flight per lane (4 spill in the one-launch combine kernel; the
// tagged rows are small).
__device__ __forceinline__ void warp_copy_tagged(char* dst, const char* src, size_t bytes, int lane, u32 tag) {
    const size_t n = bytes / 16;
    for (size_t i = lane; i < n; i += 64) {
        const int4 a = ld_cg_int4(src + i * 16);
        const bool two = i + 32 < n;
        const int4 b = two ? ld_cg_int4(src + (i + 32) * 16) : make_int4(0, 0, 0, 0);
        st_volatile_tagged(dst + i * 32, (u32)a.x, (u32)a.y, tag);
        st_volatile_tagged(dst + i * 32 + 16, (u32)a.z, (u32)a.w, tag);
        if (two) {
            st_volatile_tagged(dst + (i + 32) * 32, (u32)b.x, (u32)b.y, tag);
            st_volatile_tagged(dst + (i + 32) * 32 + 16, (u32)b.z, (u32)b.w, tag);
        }
    }
}

// A tagged send's arrival, before its payload: the arrival word and the whole stamp in one
// 16-byte relaxed store (nothing before it needs ordering: the tags guard the payload). A tagged
// dispatch's word carries its number of tokens (`tokens` >= 0, see `arrival_tagged_tokens`).
__device__ __forceinline__ void signal_now(const LlParams& p, const OpNum& n, int chan, int dest, int tokens = -1) {
    u64* pair = arrival_at(reinterpret_cast<u64*>(p.peer_signals[dest]), chan, n.set, p.rank);
    const u64 a = arrival_word(n.seq, p.cancelled != 0, p.stamp) | ((u64)(tokens + 1) << EP_ARRIVAL_SENT_SHIFT);
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(pair), "l"(a), "l"(p.stamp) : "memory");
}

// Tagged dispatch messages (flags in the payload, as the tagged combine rows). A dispatch of at
// most `tag_dispatch_tokens` tokens (<= min(EP_TAG_TOKENS, M); no peer through NCCL, no rank
// masking) writes its messages with every 4-byte word as an 8-byte pair {word, tag} into each
// destination's tagged dispatch area, [set][sender][token] after every set's plain region, one
// message per token (a token routed elsewhere: its header only, every local expert -1), and
// signals its arrival first, with its number of tokens in the arrival word: no system-scope
// fence, no count of the warps, no release after the payload (benches/NOTES.md item 75). The
// receiver waits for each 16-byte vector's tags as it reads it. The area is never cleared per
// operation: a buffer set's tags only grow from one operation to the next (what is left there
// carries an older tag), until the 32-bit tag wraps; the operation before the wrap clears the
// set's area before it returns its credits (`finish_receive`).
__device__ __forceinline__ bool sends_tagged(const LlParams& p) {
    return p.nccl_mask == 0 && p.tag_dispatch_tokens > 0 && p.num_tokens <= p.tag_dispatch_tokens &&
           p.num_tokens <= min(EP_TAG_TOKENS, p.max_tokens);
}
static_assert(EP_TAG_TOKENS + 1 < 64, "a tagged dispatch's tokens + 1 fit the arrival word's 6 bits");

// One buffer set's tagged dispatch area: min(EP_TAG_TOKENS, M) messages of 2 x `msg_bytes` per
// source.
__device__ __forceinline__ size_t tagged_dispatch_set_bytes(const LlParams& p) {
    return (size_t)min(EP_TAG_TOKENS, p.max_tokens) * p.num_ranks * 2 * p.msg_bytes;
}

// Source `src`'s tagged message for token `t` in buffer set `set` of the dispatch receive region
// at `region`.
__device__ __forceinline__ char* tagged_msg(const LlParams& p, u64 region, int set, int src, int t) {
    const size_t cap = (size_t)min(EP_TAG_TOKENS, p.max_tokens);
    return reinterpret_cast<char*>(region) + (size_t)p.num_sets * p.recv_set_bytes +
           (size_t)set * tagged_dispatch_set_bytes(p) + ((size_t)src * cap + t) * 2 * p.msg_bytes;
}

// Writes a tagged message's header: words 0..11 of the plain header (operation number, token
// `t`, the combine's tagged-rows request, the local experts), and for rank-major words 12..27
// (the weights), as pairs. Lane k < K holds entry k's local expert `le` (-1: elsewhere; -1 on
// lanes >= K too) and weight `wt`. Every lane calls.
__device__ __forceinline__ void put_head_tagged(char* msg, const LlParams& p, const OpNum& n, int t, int le, float wt,
                                                int lane, u32 tag) {
    const int a = min(31, max(0, 2 * (lane - 4)));
    const u32 lo = (u32)__shfl_sync(EP_FULL_MASK, le, a), hi = (u32)__shfl_sync(EP_FULL_MASK, le, min(31, a + 1));
    const float w = __shfl_sync(EP_FULL_MASK, wt, max(0, lane - 12));
    u32 word = __float_as_uint(w);
    if (lane < 12) word = (lo & 0xffffu) | (hi << 16);
    if (lane == 0) word = (u32)(n.seq + 1);
    if (lane == 1) word = (u32)((n.seq + 1) >> 32);
    if (lane == 2) word = (u32)t;
    if (lane == 3) word = wants_tagged(p) ? 1u : 0u;
    const u32 w0 = __shfl_sync(EP_FULL_MASK, word, (2 * lane) & 31);
    const u32 w1 = __shfl_sync(EP_FULL_MASK, word, (2 * lane + 1) & 31);
    if (lane < (p.rank_major ? 14 : 6)) st_volatile_tagged(msg + 16 * lane, w0, w1, tag);
}

// Whether the four pairs of 32 tagged bytes (`lo`, `hi`: 16 plain bytes) all carry `tag`.
__device__ __forceinline__ bool tags_are(int4 lo, int4 hi, u32 tag) {
    return (u32)lo.y == tag && (u32)lo.w == tag && (u32)hi.y == tag && (u32)hi.w == tag;
}

// Waits until the 32 tagged bytes at `at` (loaded into `lo`, `hi`) carry `tag`, reloading them;
// false at `deadline` (global timer ns; the receive's, so a reader that gave up once gives up at
// once after).
__device__ __forceinline__ bool await_tags(const char* at, u32 tag, u64 deadline, int4* lo, int4* hi) {
    while (!tags_are(*lo, *hi, tag)) {
        if (globaltimer_ns() > deadline) return false;
        *lo = ld_volatile_int4(at);
        *hi = ld_volatile_int4(at + 16);
    }
    return true;
}

// The 16 plain bytes of a tagged vector pair.
__device__ __forceinline__ int4 untag(int4 lo, int4 hi) { return make_int4(lo.x, lo.z, hi.x, hi.z); }

// The plain 4-byte word of the tagged pair at `at`, once it carries `tag` (see `await_tags`).
__device__ __forceinline__ bool ld_tagged_word(const char* at, u32 tag, u64 deadline, u32* word) {
    uint2 v;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(at) : "memory");
    while (v.y != tag) {
        if (globaltimer_ns() > deadline) return false;
        asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(at) : "memory");
    }
    *word = v.x;
    return true;
}

// Copies `bytes` (a multiple of 16) of plain bytes from tagged message bytes at `src` (2 x
// `bytes`) to `dst` with one warp, two vectors in flight per lane, each stored once its tags
// match (`await_tags`); false if one did not by the deadline.
__device__ __forceinline__ bool warp_copy_untag(char* dst, const char* src, size_t bytes, int lane, u32 tag,
                                                u64 deadline) {
    const size_t n = bytes / 16;
    for (size_t i = lane; i < n; i += 64) {
        const bool two = i + 32 < n;
        int4 a0 = ld_volatile_int4(src + i * 32), a1 = ld_volatile_int4(src + i * 32 + 16);
        int4 b0 = make_int4(0, 0, 0, 0), b1 = b0;
        if (two) {
            b0 = ld_volatile_int4(src + (i + 32) * 32);
            b1 = ld_volatile_int4(src + (i + 32) * 32 + 16);
        }
        if (!await_tags(src + i * 32, tag, deadline, &a0, &a1)) return false;
        st_na_int4(dst + i * 16, untag(a0, a1));
        if (two) {
            if (!await_tags(src + (i + 32) * 32, tag, deadline, &b0, &b1)) return false;
            st_na_int4(dst + (i + 32) * 16, untag(b0, b1));
        }
    }
    return true;
}


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
__device__ __forceinline__ void role_wait_credit(const LlParams& p, const OpNum& n, int chan, SendRole* r) {
    int skip = 0;
    if (r->lane == 0) {
        const u64 m = mask_word(p);
        skip = (int)either_masked(m, p.rank, r->dest);
        if (!skip) skip = wait_credit(p, n, chan, r->dest);
    }
    r->skip = __shfl_sync(EP_FULL_MASK, skip, 0) != 0;
}

// Reports this warp done with destination `dest`; the last of its `reporting` warps signals it.
// The warp's stores (possibly remote) are ordered before the report by one system-scope fence of
// lane 0 after a warp barrier.
__device__ __forceinline__ void signal_sent(const LlParams& p, const OpNum& n, int chan, int dest, int reporting, int lane) {
    // The warp barrier orders every lane's stores before lane 0's; its system-scope release
    // fence is cumulative over them (one fence per warp, not one per lane).
    __syncwarp();
    if (lane == 0) {
        u64* peer = reinterpret_cast<u64*>(p.peer_signals[dest]);
        u64* pair = arrival_at(peer, chan, n.set, p.rank);
        // The whole stamp (the word after the arrival word) goes out with this warp's payload,
        // under the same fence, so the arrival word's release waits for no store of its own.
        const u64 m0 = mask_word(p);
        if (!either_masked(m0, p.rank, dest)) st_relaxed_sys(pair + 1, p.stamp);
        asm volatile("fence.acq_rel.sys;" ::: "memory");
        u64* sig = reinterpret_cast<u64*>(p.signals);
        u64* sent = sig_at(sig, EP_SIG_SENT(chan), n.set, dest);
        if (atom_add_acq_rel_gpu(sent, 1) == (u64)(reporting - 1)) {
            *sent = 0;
            const u64 m = mask_word(p);
            if (!either_masked(m, p.rank, dest)) st_release_sys(pair, arrival_word(n.seq, p.cancelled != 0, p.stamp));
        }
    }
}

// A captured dispatch reads the caller's top-k buffer, refilled before every replay, instead of
// the handle's copy. Every warp sanitizes the row it sends (one entry per lane < K, all lanes
// call): the entries from the row's first invalid one on (outside [-1, E), or naming an expert
// an earlier entry named) count as -1. The `owner` warp of the token (chunk 0 to rank 0) writes
// the sanitized row into the handle, which combine reads, and reports an invalid row in the
// handle's mapped report: value at [1 + B + t], then (replay + 1) << 16 | (earlier k + 1) << 8 |
// k at [1 + t], then the replay + 1 at [0] (every reporter writes the same value).
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
            const u64 replay = __ldcg(reinterpret_cast<const u64*>(p.seq_base) + 2);
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

// Writes piece [c_begin, c_begin + width) of token row `row` into a dispatch message's payload
// at `payload`: BF16, or FP8 with its scales. TAGGED: as pairs carrying `tag` (`payload` is the
// tagged payload, twice the plain bytes at twice the offsets).
template <bool TAGGED>
__device__ __forceinline__ void dispatch_payload(const LlParams& p, char* payload, const __nv_bfloat16* row,
                                                 int c_begin, int width, int lane, u32 tag) {
    const int H = p.hidden, c_end = c_begin + width;
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

// A tagged dispatch's item (token `t`, piece `chunk`) for destination `dest`: the header with
// piece 0 (every token has one), the payload piece if the token is `routed` there (lane k < K
// holds entry k's local expert there, `le`).
__device__ __forceinline__ void send_tagged_item(const LlParams& p, const OpNum& n, int dest, int t, int chunk, int le,
                                                 bool routed, int lane) {
    const int K = p.top_k, H = p.hidden, width = H / p.chunks;
    const u32 tag = op_tag(n.seq);
    char* msg = tagged_msg(p, p.peer_recv[dest], n.set, p.rank, t);
    if (chunk == 0) {
        const float* w = reinterpret_cast<const float*>(p.weights);
        const float wt = p.rank_major && lane < K ? w[(size_t)t * K + lane] : 0.f;
        put_head_tagged(msg, p, n, t, le, wt, lane, tag);
    }
    if (routed) {
        const __nv_bfloat16* x = reinterpret_cast<const __nv_bfloat16*>(p.x);
        dispatch_payload<true>(p, msg + 2 * EP_HDR_BYTES, x + (size_t)t * H, chunk * width, width, lane, tag);
    }
}

// Each destination rank is served by `warps / R` warps; warp j of destination d handles the
// (token, chunk) items j, j + wpd, ... of d (a row is split into `chunks` equal pieces, a multiple
// of 256 channels each, so many warps move one row). When all of them are done, the last one
// signals d. Each warp fences its stores before it reports (`signal_sent`), so the signal is
// ordered after every payload store of every lane. Tagged (`sends_tagged`): the first warp of
// each destination signals at once, and the messages go out as pairs.
// SEND: which form the kernel sends in (`SEND_ANY`: as `sends_tagged` says; the one-launch
// kernels are compiled for one form each, picked by the host's mirror `LlParams::sends_tagged`:
// with both sends inlined, the plain one-launch kernel spilled 170 B instead of 20).
#define SEND_ANY 0
#define SEND_PLAIN 1
#define SEND_TAGGED 2
template <int SEND>
__device__ __forceinline__ void dispatch_send(const LlParams& p, const OpNum& n) {
    SendRole role;
    if (!send_role(p, n, 0, (long long)p.num_tokens * p.chunks, &role)) return;
    const int lane = role.lane, dest = role.dest, j = role.j, wpd = role.wpd;
    const int K = p.top_k, H = p.hidden, L = p.num_local, C = p.chunks;
    const long long* idx = reinterpret_cast<const long long*>(p.topk_src ? p.topk_src : p.topk_idx);
    // The first item's routing row is loaded before the credit wait (its latency overlaps it).
    const long long e_first = (lane < K && j < p.num_tokens * C) ? idx[(size_t)(j / C) * K + lane] : -1;
    role_wait_credit(p, n, 0, &role);
    const bool tagged = SEND == SEND_TAGGED || (SEND == SEND_ANY && sends_tagged(p));
    if (tagged && j == 0 && lane == 0 && !role.skip) signal_now(p, n, 0, dest, p.num_tokens);

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
            if (p.topk_src) e = routed_entry(p, e, t, lane, dest == 0 && chunk == 0);
            // 32-bit: a routed expert is below E (validated, or sanitized by `routed_entry`).
            const int le = (lane < K && e >= 0 && (int)e / L == dest) ? (int)e % L : -1;
            const bool routed = __ballot_sync(EP_FULL_MASK, le >= 0) != 0u;
            if (tagged) {
                send_tagged_item(p, n, dest, t, chunk, le, routed, lane);
                continue;
            }
            if (!routed) continue;
            char* msg = region + (size_t)t * p.msg_bytes;
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
            dispatch_payload<false>(p, msg + EP_HDR_BYTES, x + (size_t)t * H, chunk * width, width, lane, 0u);
        }
    }
    if (!tagged) signal_sent(p, n, 0, dest, role.reporting, lane);
}

// With masking: one thread per source waits for its arrival until it arrives, is masked (by a
// peer, or here at the deadline: `spread_mask`), or this rank is masked. Then the first block of
// the operation to get past its waits decides the absent sources for every block: the mask as it
// stands then (it holds every source that block gave up on, so every source it leaves present
// has arrived). Every thread of the block calls it; ends with a barrier.
__device__ void wait_sources_masked(const LlParams& p, const OpNum& n, int chan, u32* cancelled, u32* mismatched,
                                    u32* absent) {
    u64* sig = reinterpret_cast<u64*>(p.signals);
    if (threadIdx.x == 0) {
        *cancelled = 0u;
        *mismatched = 0u;
    }
    const int s = threadIdx.x;
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
        const int v = wait_arrival(sig, chan, n.set, s, n.seq, p.stamp, deadline);
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
// `wait_all_sources`; never tagged with masking).
__device__ bool ll_wait_all_sources(const LlParams& p, const OpNum& n, int chan, u32* cancelled, u32* mismatched,
                                    int* timed_out, u32* absent, int* sent = nullptr) {
    if (p.masking) {
        if (sent && (int)threadIdx.x < p.num_ranks) sent[threadIdx.x] = -1;
        wait_sources_masked(p, n, chan, cancelled, mismatched, absent);
        return true;
    }
    if (threadIdx.x == 0) *absent = 0u;
    const bool ok = wait_all_sources(reinterpret_cast<u64*>(p.signals), reinterpret_cast<u64*>(p.status), p.num_ranks,
                                     chan, n.set, n.seq, p.stamp, p.timeout_ns, cancelled, mismatched, timed_out, sent);
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
__device__ __forceinline__ void advance_step(const LlParams& p, int chan) {
    u64* b = reinterpret_cast<u64*>(p.seq_base) - chan;
    if (b[6] != ((((u64)chan) << 32) | p.seq) + 1) return;
    b[0] += b[4];
    b[1] += b[5];
    b[2] += 1;
}

// Block 0 publishes the operation's outcome (the cancelled, mismatched and absent sources, for the
// host) as soon as its wait judged the sources: every block judges them alike. Written this early,
// the host's word is out long before the credits, whose system-scope release must order it (so no
// later operation on this set can publish before this one) and no longer waits for it.
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

// The last block's thread 0, once every block is `done`: resets the count, writes the host's words,
// then returns the credits of this buffer set to every source.
__device__ __forceinline__ void return_credits(const LlParams& p, const OpNum& n, int chan, u32 cancelled,
                                               u32 mismatched, u32 absent, u64* done) {
    *done = 0;
    if (chan == 0) done[EP_DONE_LANDED - chan] = 0;  // `land_tagged`'s meeting
    // The host's words, then the credits (each a system-scope release, ordered after the
    // words, block 0's outcome among them, and after every block's reads of this set,
    // which came before through `done`).
    if (p.masking) st_relaxed_sys(reinterpret_cast<u64*>(p.status) + EP_STATUS_MASK, mask_word(p));
    if (p.verdict && (cancelled | mismatched)) report_failure(p, n, chan, cancelled, mismatched);
    // One release fence for all the credits (with the relaxed stores after it, a release
    // pattern each): a release store per credit would wait for the previous credit's
    // store to reach its peer, a round trip over NVLink per source.
    asm volatile("fence.acq_rel.sys;" ::: "memory");
    for (int s = 0; s < p.num_ranks; s++) {
        if ((absent >> s) & 1u) continue;  // masked: no credit (it may be gone; rejoin resets them)
        u64* peer = reinterpret_cast<u64*>(p.peer_signals[s]);
        st_relaxed_sys(sig_at(peer, EP_SIG_CONSUMED(chan), n.set, p.rank), (n.seq + 1) << 1);
    }
    if (p.seq_base) advance_step(p, chan);
    if (p.trace && n.seq % 64 == 0) trace_print(p.rank, chan, n.seq);
}

// The last block to finish returns the credits of this buffer set to every source (after block
// 0's `publish_early`, through `done`).
// `blocks`: the blocks of the grid that take part in the receive (the first ones). A dispatch
// whose buffer set's next operation has a smaller tag (the 32-bit tag wraps) first clears the
// set's tagged dispatch area, with the whole last block (see `sends_tagged`).
__device__ void finish_receive(const LlParams& p, const OpNum& n, int chan, u32 cancelled, u32 mismatched, u32 absent,
                               int blocks) {
    __syncthreads();
    u64* done = sig_at(reinterpret_cast<u64*>(p.signals), EP_SIG_DONE, n.set, chan);
    if (chan == 0 && op_tag(n.seq + (u64)p.num_sets) <= op_tag(n.seq)) {
        __shared__ int last;
        if (threadIdx.x == 0) last = atom_add_acq_rel_gpu(done, 1) == (u64)(blocks - 1);
        __syncthreads();
        if (!last) return;
        char* area = tagged_msg(p, p.own_recv, n.set, 0, 0);
        const size_t vectors = tagged_dispatch_set_bytes(p) / 16;
        for (size_t i = threadIdx.x; i < vectors; i += blockDim.x) st_na_int4(area + i * 16, make_int4(0, 0, 0, 0));
        __syncthreads();  // the clearing before thread 0's release of the credits
        if (threadIdx.x == 0) return_credits(p, n, chan, cancelled, mismatched, absent, done);
        return;
    }
    // The barrier above and the release of the add order every thread's reads and writes of
    // this block before it (the release is cumulative).
    if (threadIdx.x == 0 && atom_add_acq_rel_gpu(done, 1) == (u64)(blocks - 1)) {
        return_credits(p, n, chan, cancelled, mismatched, absent, done);
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
    int tagged;  // the sender's combine wants tagged rows
    int4 a, b;
};

__device__ __forceinline__ MsgHead load_head(const char* msg, int K) {
    MsgHead h;
    const int4 w = ld_cg_int4(msg);
    h.seq = (u64)(u32)w.x | ((u64)(u32)w.y << 32);
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

// The tagged counterpart of a received row's copy in `dispatch_recv`: piece `part` (of `piece`
// plain bytes) of source s = slot / M's tagged message for token t = slot % M into output row
// `out_row`, and with part 0 the rank-major weights and local experts and the FP8 scales, each
// word once its tags match. False when one never came (reported: its source stopped mid-send).
__device__ __forceinline__ bool copy_tagged_piece(const LlParams& p, const OpNum& n, int slot, size_t out_row, int part,
                                                  size_t piece, int lane, u64 deadline) {
    const u32 tag = op_tag(n.seq);
    const int K = p.top_k, H = p.hidden, s = slot / p.max_tokens;
    const char* msg = tagged_msg(p, p.own_recv, n.set, s, slot % p.max_tokens);
    const size_t payload_bytes = p.fp8 ? (size_t)H : (size_t)H * 2;
    bool ok = true;
    if (p.rank_major && part == 0 && lane < K) {
        u32 w = 0u, pair = 0u;
        ok = ld_tagged_word(msg + 2 * (EP_HDR_WEIGHTS + 4 * lane), tag, deadline, &w);
        ok = ok && ld_tagged_word(msg + 2 * (16 + 4 * (lane / 2)), tag, deadline, &pair);
        reinterpret_cast<float*>(p.out_weights)[out_row * K + lane] = __uint_as_float(w);
        const u32 half = (lane & 1) ? pair >> 16 : pair;
        reinterpret_cast<int*>(p.out_idx)[out_row * K + lane] = (int)(short)(unsigned short)half;
    }
    const char* payload = msg + 2 * EP_HDR_BYTES;
    ok = ok && warp_copy_untag(reinterpret_cast<char*>(p.out) + out_row * payload_bytes + part * piece,
                               payload + 2 * part * piece, piece, lane, tag, deadline);
    if (p.fp8 && part == 0) {
        const int cols = H / 128;
        float* dst = reinterpret_cast<float*>(p.out_scales) + out_row * cols;
        for (int c = lane; ok && c < cols; c += 32) {
            u32 v = 0u;
            ok = ld_tagged_word(payload + 2 * (H + 4 * c), tag, deadline, &v);
            dst[c] = __uint_as_float(v);
        }
    }
    if (!ok) report_lost(p, n, 0, s);
    return ok;
}

// The receive's work once every source arrived (see `dispatch_recv`). TAGGED: some source sent
// tagged messages (`tagged_tokens[s]` >= 0): their headers and payloads are read from the tagged
// area as their tags say they came; `skip`: the sources whose data is not taken.
template <bool TAGGED>
__device__ __forceinline__ void dispatch_recv_tasks(const LlParams& p, const OpNum& n, u32 skip,
                                                    const int* tagged_tokens, u64 tag_deadline, int* warp_sums,
                                                    int* entry_slot) {
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
    const int first_slot = rm ? q * M : 0, span = rm ? M : RM;
    const size_t group_base = rm ? (size_t)q * M : (size_t)q * RM;  // output row of the group's row 0
    int base = 0;
    for (int chunk = 0; chunk < span; chunk += blockDim.x) {
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
        int chunk_total;
        const int pos = block_rank_of_flag(k_sel >= 0, warp_sums, &total_shared, &chunk_total);
        if (k_sel >= 0) {
            entry_slot[pos] = slot;
            if (g == 0) row_of[(size_t)slot * K + k_sel] = (int)group_base + base + pos;
        }
        __syncthreads();
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
            const int slot = entry_slot[e];
            const size_t out_row = group_base + row;
            if (TAGGED && tagged_tokens[slot / M] >= 0) {
                copy_tagged_piece(p, n, slot, out_row, part, piece, lane, tag_deadline);
                continue;
            }
            const char* msg = recv + (size_t)slot * p.msg_bytes;
            const char* payload = msg + EP_HDR_BYTES;
            if (rm && part == 0 && lane < K) {
                reinterpret_cast<float*>(p.out_weights)[out_row * K + lane] =
                    __ldcg(reinterpret_cast<const float*>(msg + EP_HDR_WEIGHTS) + lane);
                reinterpret_cast<int*>(p.out_idx)[out_row * K + lane] =
                    (int)__ldcg(reinterpret_cast<const short*>(msg + 16) + lane);
            }
            // FP8: the row's scales (part 0) load before the payload copy and store after it, so
            // their latency overlaps the copy's instead of following it.
            const int cols = H / 128;
            const bool scales_here = p.fp8 && part == 0;
            const float* ssrc = reinterpret_cast<const float*>(payload + H);
            float s0 = 0.f, s1 = 0.f;
            if (scales_here) {
                if (lane < cols) s0 = __ldcg(ssrc + lane);
                if (lane + 32 < cols) s1 = __ldcg(ssrc + lane + 32);
            }
            warp_copy_n<4>(reinterpret_cast<char*>(p.out) + out_row * payload_bytes + part * piece, payload + part * piece, piece,
                           lane);
            if (scales_here) {
                float* dst = reinterpret_cast<float*>(p.out_scales) + out_row * cols;
                if (lane < cols) dst[lane] = s0;
                if (lane + 32 < cols) dst[lane + 32] = s1;
                for (int c = lane + 64; c < cols; c += 32) dst[c] = __ldcg(ssrc + c);
            }
        }
        base += chunk_total;
        __syncthreads();
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
    // task above (so this runs beside the copies, not after block 0's), else block 0.
    if ((int)blockIdx.x == ((int)gridDim.x > Q * G ? (int)gridDim.x - 1 : 0)) {
        __shared__ int src_start[EP_MAX_RANKS + 1];
        __shared__ int src_tagged[EP_MAX_RANKS];
        if ((int)threadIdx.x < R) src_tagged[threadIdx.x] = 0;
        __syncthreads();
        int* list = reinterpret_cast<int*>(p.ret_list);
        int base = 0;
        for (int chunk = 0; chunk < RM; chunk += blockDim.x) {
            const int slot = chunk + threadIdx.x;
            u32 back = 0u;
            if (slot < RM) {
                MsgHead h;
                const bool valid = !((skip >> (slot / M)) & 1u) &&
                                   slot_head(p, n, recv, slot, TAGGED ? tagged_tokens[slot / M] : -1, tag_deadline, &h);
                back = valid ? head_entries(h, K, rm) : 0u;
                if (valid && h.tagged == 1) src_tagged[slot / M] = 1;  // every such slot agrees
                for (int k = 0; k < K; k++) {
                    if (!((back >> k) & 1u)) row_of[(size_t)slot * K + k] = -1;
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
                const int t_k = (slot % M) * K;
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
    const size_t vecs = (p.fp8 ? (size_t)p.hidden + 4 * (p.hidden / 128) : (size_t)p.hidden * 2) / 16;
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
// item 75).
template <bool LAND>
__device__ __forceinline__ void dispatch_recv(const LlParams& p, const OpNum& n) {
    __shared__ u32 cancelled, mismatched, absent;
    __shared__ int timed_out;
    __shared__ int tagged_tokens[EP_MAX_RANKS];  // per source: the tokens of a tagged dispatch, or -1
    __shared__ u64 tag_deadline;                 // the waits for tagged messages give up then
    __shared__ int warp_sums[17];                // a word per warp, then the block's total (block scans)
    __shared__ int entry_slot[512];
    // Two timeouts from now: the arrivals' wait, then the tagged messages' (the deadline is set
    // before the wait so that no load or barrier follows it).
    if (threadIdx.x == 0) tag_deadline = globaltimer_ns() + 2 * p.timeout_ns;
    if (!ll_wait_all_sources(p, n, 0, &cancelled, &mismatched, &timed_out, &absent, tagged_tokens)) return;
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
    if (any_tagged && !LAND) {
        dispatch_recv_tasks<true>(p, n, skip, tagged_tokens, tag_deadline, warp_sums, entry_slot);
    } else {
        dispatch_recv_tasks<false>(p, n, skip, tagged_tokens, tag_deadline, warp_sums, entry_slot);
    }
    trace_at(p, 0, 3);
    finish_receive(p, n, 0, cancelled, mismatched, absent, gridDim.x);
}


// Combine send, on the expert side: every received (source s, token t, k) row of the expert
// output goes back to s, at [t][k] of its receive region, split in `chunks` pieces. Warps are
// split over sources as in dispatch; a source's warps share out the entries of its return list
// (only rows that go back: the row map's -1 entries take no warp's turn, so no warp gets more
// than its share when the routing clusters). A source that asked for tagged rows (its count's
// EP_RET_TAGGED bit) gets them in its tagged area, and its arrival before them (`signal_now`);
// so does one that gets no rows (nothing to order).
__device__ __forceinline__ void combine_send(const LlParams& p, const OpNum& n) {
    const int C = p.chunks;
    const int d = send_dest(p);
    const int K = p.top_k, H = p.hidden, M = p.max_tokens;
    const bool serves = d < p.num_ranks;
    const int* list = reinterpret_cast<const int*>(p.ret_list) + (size_t)(serves ? d : 0) * M * K;
    // The source's count and this warp's first entry load together (the entry's place does not
    // depend on the count; it is used only if the count covers it), then its row, all before the
    // credit wait (their latency overlaps it).
    const int j0 = send_j(p);
    const int raw_count = serves ? __ldcg(reinterpret_cast<const int*>(p.ret_count) + d) : 0;
    const int count = raw_count & ~EP_RET_TAGGED;
    const bool tagged = (raw_count & EP_RET_TAGGED) != 0;
    const int i_first = serves && j0 / C < M * K ? __ldcg(list + j0 / C) : 0;
    SendRole role;
    if (!send_role(p, n, 1, (long long)count * C, &role)) return;
    const int lane = role.lane, dest = role.dest, j = role.j, wpd = role.wpd;
    const int* row_of = reinterpret_cast<const int*>(p.row_of) + (size_t)dest * M * K;
    const int row_first = j < count * C ? __ldcg(row_of + i_first) : 0;
    role_wait_credit(p, n, 1, &role);
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
            const int row = item == j ? row_first : __ldcg(row_of + i);
            const int c = chunk * width;
            const __nv_bfloat16* src = ex + (size_t)row * H + c;
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
// taken once its four tags match and then cleared; summed exactly as `combine_rows` does and
// written when `write`. False when a row stops arriving (its source signalled, then never sent
// it): the error is reported.
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
                st_na_int4(at[j], make_int4(0, 0, 0, 0));
                st_na_int4(at[j] + 16, make_int4(0, 0, 0, 0));
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
// made the one-launch combine spill 352 B and cost expert-major 128 tokens 7 us).
template <bool TAGGED>
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
    const int tpi = min((int)blockDim.x, ((width / 8 + G - 1) / G + 31) / 32 * 32);
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
    // the other sources are still taken and cleared (the area must hold no stale row).
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

// The kernels. Two launches (staged operations, and any operation whose grid cannot be all
// resident): the send half, then the complete half. One launch (the synchronous form, launched
// cooperatively so every block is resident): each block sends its share, then takes its receive
// tasks; a block waiting for arrivals never keeps a sender of this kernel off the GPU. A
// one-launch grid has at most one block per SM, and its registers are bounded so that two blocks
// fit on an SM: the other channel's one-launch kernel (ranks may interleave the channels
// differently) always finds room beside a waiting one.
extern "C" __global__ void __launch_bounds__(512) ep_ll_dispatch_send(LlParams p) {
    trace_at(p, 0, 0);
    const OpNum n = op_num(p, 0);
    if (!n.dead) dispatch_send<SEND_ANY>(p, n);
    trace_at(p, 0, 1);
}
extern "C" __global__ void __launch_bounds__(512) ep_ll_dispatch_recv(LlParams p) {
    const OpNum n = op_num(p, 0);
    if (!n.dead) dispatch_recv<false>(p, n);
}
// TAGGED: this rank sends tagged messages (`LlParams::sends_tagged`, the host's mirror of
// `sends_tagged`): `ep_ll_dispatch_kernel_tagged`.
template <bool TAGGED>
__device__ __forceinline__ void dispatch_one(const LlParams& p) {
    const OpNum n = op_num(p, 0);
    if (n.dead) return;
    trace_at(p, 0, 0);
    dispatch_send<TAGGED ? SEND_TAGGED : SEND_PLAIN>(p, n);
    trace_at(p, 0, 1);
    dispatch_recv<!TAGGED>(p, n);
}
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_dispatch_kernel(LlParams p) { dispatch_one<false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_dispatch_kernel_tagged(LlParams p) { dispatch_one<true>(p); }
// The combine send is held to two blocks per SM (62 registers for sm_90, no spills; left to
// itself ptxas takes 82), so a send block leaves room on its SM for another operation's receive.
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_combine_send(LlParams p) {
    trace_at(p, 1, 0);
    const OpNum n = op_num(p, 1);
    if (!n.dead) combine_send(p, n);
    trace_at(p, 1, 1);
}
extern "C" __global__ void __launch_bounds__(256) ep_ll_combine_recv(LlParams p) {
    const OpNum n = op_num(p, 1);
    if (!n.dead) combine_recv<false>(p, n);
}
extern "C" __global__ void __launch_bounds__(256) ep_ll_combine_recv_tagged(LlParams p) {
    const OpNum n = op_num(p, 1);
    if (!n.dead) combine_recv<true>(p, n);
}
template <bool TAGGED>
__device__ __forceinline__ void combine_one(const LlParams& p) {
    const OpNum n = op_num(p, 1);
    if (n.dead) return;
    trace_at(p, 1, 0);
    combine_send(p, n);
    trace_at(p, 1, 1);
    combine_recv<TAGGED>(p, n);
}
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_combine_kernel(LlParams p) { combine_one<false>(p); }
extern "C" __global__ void __launch_bounds__(512, 2) ep_ll_combine_kernel_tagged(LlParams p) { combine_one<true>(p); }

// Captured steps (graph/ in epflow-kernels).
//
// `bases` is the step's [dispatch base, combine base, replay, failed, ...] in device memory (see
// `advance_step`): the numbers its operations add their places to, the replay's index, and
// whether an operation of the step timed out on this rank (set by `mark_step_failed`; never
// cleared: the group is poisoned). The step's last operation advances them after each replay;
// this one-thread kernel sets them before a replay whose channels moved on without the step
// (operations outside it took numbers in between), or before the first.
extern "C" __global__ void ep_graph_rebase(u64 bases, u64 dispatch, u64 combine, u64 replay) {
    u64* b = reinterpret_cast<u64*>(bases);
    b[0] = dispatch;
    b[1] = combine;
    b[2] = replay;
}

// Rank masking from the host (epflow_core::mask; `mask.rs` in epflow-kernels). One thread each.
struct MaskParams {
    u64 signals;                     // this rank's signal page
    u64 status;                      // this rank's status page (mapped host)
    u64 peer_signals[EP_MAX_RANKS];  // every rank's signal page
    u64 bits;                        // ep_mask_spread: the ranks to mask
    u64 epoch;                       // ep_mask_rejoin: the number of this unmask_all (1, 2, ...)
    u64 next[3];                     // ep_mask_rejoin: this rank's next operation number per channel
    u64 timeout_ns;
    int rank, num_ranks;
};
static_assert(sizeof(MaskParams) == 136, "MaskParams layout");

// `GpuRank::mask_ranks`: ORs `bits` into every rank's word (this one's first) and mirrors it.
extern "C" __global__ void ep_mask_spread(MaskParams m) {
    mask_everywhere(m.signals, m.peer_signals, m.status, m.rank, m.num_ranks, m.bits);
}

// Waits until board word `i` of every rank in this rank's mask area reaches `epoch`; false (and
// the first missing rank reported) at the deadline.
__device__ bool rejoin_meet(const MaskParams& m, u64* area, int i, u64 deadline) {
    for (int r = 0; r < m.num_ranks; r++) {
        while (ld_acquire_sys(area + EP_MASK_REJOIN + r * 5 + i) < m.epoch) {
            if (globaltimer_ns() > deadline) {
                report_error(reinterpret_cast<u64*>(m.status), EP_ERR_REJOIN, r, m.epoch);
                return false;
            }
        }
    }
    return true;
}

// `GpuRank::unmask_all` (every rank, no operation in flight): post this rank's next operation
// numbers on every rank's board and meet; take the largest of each channel; set every credit of
// this rank's page as if every operation before it had been consumed, clear the local counters
// and the mask word, and tell the host the numbers; meet again (nobody sends before every rank has
// reset, so no credit written for a new operation is overwritten).
extern "C" __global__ void ep_mask_rejoin(MaskParams m) {
    u64* page = reinterpret_cast<u64*>(m.signals);
    u64* area = mask_area(page);
    u64* status = reinterpret_cast<u64*>(m.status);
    const u64 deadline = globaltimer_ns() + m.timeout_ns;
    for (int r = 0; r < m.num_ranks; r++) {
        u64* b = mask_area(reinterpret_cast<u64*>(m.peer_signals[r])) + EP_MASK_REJOIN + m.rank * 5;
        for (int c = 0; c < 3; c++) st_relaxed_sys(b + 1 + c, m.next[c]);
        st_release_sys(b, m.epoch);
    }
    if (!rejoin_meet(m, area, 0, deadline)) return;
    u64 next[3] = {0, 0, 0};
    for (int r = 0; r < m.num_ranks; r++) {
        for (int c = 0; c < 3; c++) next[c] = max(next[c], ld_acquire_sys(area + EP_MASK_REJOIN + r * 5 + 1 + c));
    }
    for (int c = 0; c < 3; c++) {
        for (int set = 0; set < EP_MAX_SETS; set++) {
            for (int r = 0; r < EP_MAX_RANKS; r++) {
                *sig_at(page, EP_SIG_CONSUMED(c), set, r) = next[c] << 1;
                *sig_at(page, EP_SIG_SENT(c), set, r) = 0ull;
            }
        }
    }
    for (int set = 0; set < EP_MAX_SETS; set++) {
        for (int c = 0; c < 3; c++) *sig_at(page, EP_SIG_DONE, set, c) = 0ull;
    }
    *area = 0ull;
    for (int c = 0; c < 3; c++) st_relaxed_sys(status + EP_STATUS_REJOIN + c, next[c]);
    st_relaxed_sys(status + EP_STATUS_MASK, 0ull);
    __threadfence_system();
    for (int r = 0; r < m.num_ranks; r++) {
        st_release_sys(mask_area(reinterpret_cast<u64*>(m.peer_signals[r])) + EP_MASK_REJOIN + m.rank * 5 + 4, m.epoch);
    }
    rejoin_meet(m, area, 4, deadline);
}

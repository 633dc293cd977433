// epflow low-latency kernels, part 2 of 7 (after ll_base.cuh): the tagged protocol's helpers
// (flags in the payload: tagged combine rows and tagged dispatch messages).

// Tagged combine rows (flags in the payload). A token owner whose combine's rows fit its tagged
// area (`wants_tagged`: rank-major, at most `tag_tokens` tokens; expert-major, at most
// `tag_tokens` x R rows of K per token) and that reaches no peer through NCCL asks for its rows
// back tagged, in word 3 of each dispatch message: the expert side then sends each row as 8-byte
// pairs {two BF16 channels, the operation's tag} into the owner's tagged area, and signals its
// arrival at once, before the payload: no system-scope fence, no count of its warps, no release
// after the payload (about 3 us of a 1-token combine's send, benches/NOTES.md items 69 and 72).
// The receiver takes a pair once its tag matches. Nothing is cleared per operation (as in the
// tagged dispatch area below): a buffer set's tags only grow from one operation to the next, so
// what is left there carries an older tag, until the 32-bit tag wraps; the operation before the
// wrap clears the set's area before it returns its credits (`finish_receive`). Clearing every
// pair after reading it cost a rank-major combine ~0.2 us at 1 token and ~0.4 at 32 on 2 x H200
// (benches/NOTES.md item 170). Twice the bytes over NVLink: at more tokens the fenced form is
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

// One buffer set's tagged combine area: min(EP_TAG_TOKENS, M) x R rows of 4 H bytes.
__device__ __forceinline__ size_t tagged_combine_set_bytes(const LlParams& p) {
    return (size_t)min(EP_TAG_TOKENS, p.max_tokens) * p.num_ranks * p.hidden * 4;
}

// Tagged row `row` (rank-major t * R + r, expert-major t * K + k) of buffer set `set` in the
// combine receive region at `region` (after every set's plain part of `recv_set_bytes`).
__device__ __forceinline__ char* tagged_row(const LlParams& p, u64 region, int set, int row) {
    return reinterpret_cast<char*>(region) + (size_t)p.num_sets * p.recv_set_bytes +
           (size_t)set * tagged_combine_set_bytes(p) + (size_t)row * p.hidden * 4;
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
// dispatch's word carries its number of tokens (`tokens` >= 0, see `arrival_tagged_tokens`), or
// with `rows` >= 0 its number of compacted messages (`arrival_word_compact`; not when cancelled).
__device__ __forceinline__ void signal_now(const LlParams& p, const OpNum& n, int chan, int dest, int tokens = -1,
                                           int rows = -1) {
    u64* pair = arrival_at(reinterpret_cast<u64*>(p.peer_signals[dest]), chan, n.set, p.rank);
    const u64 a = rows >= 0 && !p.cancelled
                      ? arrival_word_compact(n.seq, p.stamp, rows, true)
                      : arrival_word(n.seq, p.cancelled != 0, p.stamp) | ((u64)(tokens + 1) << EP_ARRIVAL_SENT_SHIFT);
    asm volatile("st.relaxed.sys.global.v2.u64 [%0], {%1, %2};" ::"l"(pair), "l"(a), "l"(p.stamp) : "memory");
}

// Tagged dispatch messages (flags in the payload, as the tagged combine rows). A dispatch of at
// most `tag_dispatch_tokens` tokens (<= min(EP_TAG_TOKENS, M); no peer through NCCL, no rank
// masking) writes its messages with every 4-byte word as an 8-byte pair {word, tag} into each
// destination's tagged dispatch area, [set][sender][token] after every set's plain region, one
// message per token (a token routed elsewhere: its header only, every local expert -1; on a
// rank-major handle, compacted as the plain messages: the i-th token routed there in message i,
// the others send nothing), and signals its arrival first, with its number of tokens (or of
// compacted messages) in the arrival word: no system-scope fence, no count of the warps, no
// release after the payload (benches/NOTES.md items 75 and 128). The receiver waits for each
// 16-byte vector's tags as it reads it. The area is never cleared per operation: a buffer set's
// tags only grow from one operation to the next (what is left there carries an older tag),
// until the 32-bit tag wraps; the operation before the wrap clears the set's area before it
// returns its credits (`finish_receive`).
__device__ __forceinline__ bool sends_tagged(const LlParams& p) {
    return p.nccl_mask == 0 && p.tag_dispatch_tokens > 0 && p.num_tokens <= p.tag_dispatch_tokens &&
           p.num_tokens <= min(EP_TAG_TOKENS, p.max_tokens);
}
static_assert(EP_TAG_TOKENS + 1 < EP_ARRIVAL_SENT_TAGGED_COMPACT,
              "a tagged dispatch's tokens + 1 fit the arrival word's 6 bits below the compacted forms");

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

// The tagged pair {word, tag} at `at`, loaded now (`await_word` waits for its tag).
__device__ __forceinline__ uint2 ld_tagged_pair(const char* at) {
    uint2 v;
    asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(at) : "memory");
    return v;
}

// Waits until the tagged pair at `at` (loaded into `v`) carries `tag`, reloading it; false at
// `deadline` (see `await_tags`). Its loads issued early, a pair's wait overlaps other loads'.
__device__ __forceinline__ bool await_word(const char* at, u32 tag, u64 deadline, uint2* v) {
    while (v->y != tag) {
        if (globaltimer_ns() > deadline) return false;
        *v = ld_tagged_pair(at);
    }
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

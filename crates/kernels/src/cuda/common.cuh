// epflow: device helpers shared by every kernel. Compiled at run time with NVRTC (sm_90).
#include <cuda_bf16.h>
#include <cuda_fp8.h>

typedef unsigned long long u64;
typedef unsigned int u32;

#define EP_MAX_RANKS 8
#define EP_MAX_TOPK 16
#define EP_MAX_SETS 16
#define EP_HDR_BYTES 128
#define EP_FULL_MASK 0xffffffffu

// Host-visible status page (pinned, mapped; the Rust mirror is params.rs):
// [0] = the first error (0 = none): code | peer << 8 | seq << 16;
// [1 + chan * EP_MAX_SETS + set] = of the last completed operation of (channel, set):
//     (seq + 1) << 32 | mismatched sources << 16 | cancelled sources;
// [1 + 3 * EP_MAX_SETS + chan * EP_MAX_SETS + set] = the stamp of its lowest mismatched source;
// [EP_STATUS_MASK] = the mask word this rank's kernels last saw (rank masking, see below);
// [EP_STATUS_REJOIN + chan] = the next operation number of each channel after `ep_mask_rejoin`.
// Outcome bits 8..15 are the sources the operation treated as absent (masked).
// Channels: 0 dispatch, 1 combine, 2 handle (the high-throughput count exchange).
#define EP_ERR_TIMEOUT_ARRIVAL 1ull
#define EP_ERR_TIMEOUT_CREDIT 2ull
#define EP_ERR_TIMEOUT_RING 3ull
#define EP_ERR_MISMATCH 4ull
#define EP_ERR_REJOIN 5ull
#define EP_ERR_MEET 6ull
#define EP_STATUS_STAMPS (1 + 3 * EP_MAX_SETS)
#define EP_STATUS_MASK (1 + 6 * EP_MAX_SETS)
#define EP_STATUS_REJOIN (EP_STATUS_MASK + 1)

// The signal page of a rank starts with the arrival pairs, [chan][set][source] x {arrival,
// stamp}: a sender writes its stamp (what the ranks must agree on: top-k, pass, handle or
// paired dispatch; see epflow_core::stamp), then, with release, its arrival word (operation
// number, stamp tag, cancelled: `arrival_word`). The pair is adjacent so the NCCL transport moves
// both in one 16-byte transfer. Then arrays of u64 indexed [array][set][rank].
#define EP_ARRIVAL_WORDS (3 * EP_MAX_SETS * EP_MAX_RANKS * 2)
#define EP_SIG_CONSUMED(chan) (chan)  // written by receivers: (seq + 1) << 1 (the sender's credit)
#define EP_SIG_SENT(chan) (3 + (chan))  // local: warps done sending, per destination
#define EP_SIG_DONE 6                   // local: blocks done receiving, [set][chan]
#define EP_SIG_ABORT(chan) (7 + (chan)) // high-throughput, [seq % 2][peer]: seq + 1 once that peer's
                                        // receiver saw this rank's stamp mismatch (stop sending to it)
#define EP_SIG_MASK 10             // rank masking: see `mask_area`
#define EP_SIG_ARRAYS 11
#define EP_SIG_ARRAY_WORDS (EP_ARRIVAL_WORDS + EP_SIG_ARRAYS * EP_MAX_SETS * EP_MAX_RANKS)

__device__ __forceinline__ u64* sig_at(u64* page, int array, int set, int rank) {
    return page + EP_ARRIVAL_WORDS + ((size_t)array * EP_MAX_SETS + set) * EP_MAX_RANKS + rank;
}

// Rank masking (epflow_core::mask). A rank's mask area (one array of its signal page):
// [0] the mask word: bit r = rank r is masked (peers OR bits in over NVLink; never cleared but by
//     `ep_mask_rejoin`);
// [EP_MASK_DECISION + chan * EP_MAX_SETS + set] the absent sources of the operation of (chan, set)
//     the first block to finish waiting decided: (seq + 1) << 8 | absent;
// [EP_MASK_REJOIN + r * 5 + i] `ep_mask_rejoin`'s meeting board: rank r's epoch (i = 0), its next
//     operation numbers (1..3), the epoch it has reset for (4);
// [EP_MASK_MEET + r] `ep_meet`'s board: the last meeting rank r came to (1, 2, ...).
#define EP_MASK_DECISION 8
#define EP_MASK_REJOIN 40
#define EP_MASK_MEET (EP_MASK_REJOIN + 5 * EP_MAX_RANKS)
static_assert(EP_MASK_MEET + EP_MAX_RANKS <= EP_MAX_SETS * EP_MAX_RANKS, "the mask area holds the meeting board");
__device__ __forceinline__ u64* mask_area(u64* page) { return page + EP_ARRIVAL_WORDS + (size_t)EP_SIG_MASK * EP_MAX_SETS * EP_MAX_RANKS; }

__device__ __forceinline__ u64* arrival_at(u64* page, int chan, int set, int rank) {
    return page + (((size_t)chan * EP_MAX_SETS + set) * EP_MAX_RANKS + rank) * 2;
}

__device__ __forceinline__ u64 ld_acquire_sys(const u64* p) {
    u64 v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void st_release_sys(u64* p, u64 v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_release_gpu(u64* p, u64 v) {
    asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ void st_relaxed_sys(u64* p, u64 v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ u64 atom_add_acq_rel_gpu(u64* p, u64 v) {
    u64 old;
    asm volatile("atom.add.acq_rel.gpu.global.u64 %0, [%1], %2;" : "=l"(old) : "l"(p), "l"(v) : "memory");
    return old;
}

__device__ __forceinline__ u64 globaltimer_ns() {
    u64 t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// 16-byte loads that bypass L1 (data written by peers or by earlier kernels).
__device__ __forceinline__ int4 ld_cg_int4(const void* p) {
    return __ldcg(reinterpret_cast<const int4*>(p));
}

// 16-byte stores that do not allocate in L1 (bulk payload, often to a peer).
__device__ __forceinline__ void st_na_int4(void* p, int4 v) {
    asm volatile("st.global.L1::no_allocate.v4.s32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(v.x), "r"(v.y), "r"(v.z),
                 "r"(v.w)
                 : "memory");
}

// Flags in the payload (the low-latency combine's tagged rows, ll.cu): a 16-byte unit is two
// 8-byte pairs {data word, tag}, stored and loaded as one vector (volatile, as NCCL's LL protocol
// does); the receiver checks both tags, so it never needs a fence or a count ahead of the data.
__device__ __forceinline__ void st_volatile_tagged(void* p, u32 d0, u32 d1, u32 tag) {
    asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(d0), "r"(tag), "r"(d1), "r"(tag)
                 : "memory");
}

__device__ __forceinline__ int4 ld_volatile_int4(const void* p) {
    int4 v;
    asm volatile("ld.volatile.global.v4.s32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}

// Records the first error in the host-visible status page: code | peer << 8 | seq << 16 (later
// errors, often consequences of the first, are dropped). Plain loads and stores: the page is
// mapped host memory, which takes no system-scope atomics on every platform (compute-sanitizer
// reports them); two errors at the same moment may leave either.
__device__ __forceinline__ void report_error(u64* status, u64 code, int peer, u64 seq) {
    if (ld_acquire_sys(status) == 0ull) st_relaxed_sys(status, code | ((u64)peer << 8) | (seq << 16));
}

// An arrival word: ((seq + 1) mod 2^34) << 30 | sent << 24 | tag << 1 | cancelled. The tag is the
// part of the sender's stamp a receiver checks on its fast path, in the same load that sees the
// arrival: top-k (5 bits), pass (1), pairing kind (2), layout (1) and the low 14 bits of the
// pairing number. `sent` (6 bits) is 0, or for a low-latency dispatch sent as tagged messages
// (ll.cu, `sends_tagged`) its number of tokens + 1: the arrival then comes before the messages;
// or EP_ARRIVAL_SENT_COMPACT for a rank-major dispatch whose plain messages sit compacted (the
// copy of the sender's i-th token routed to the receiver in slot i, `LlParams::send_slot`), or
// EP_ARRIVAL_SENT_TAGGED_COMPACT for one whose tagged messages sit compacted the same way (the
// arrival then comes first, as for any tagged dispatch): the tag's pairing-number bits, always 0
// for a dispatch (it pairs with nothing), then carry the number of those messages instead
// (`arrival_compact_rows`), and the receiver checks the tag's other bits only. The whole stamp
// is the word after it (read only to report a mismatch).
// Operations 2^34 apart on one channel and set would look alike; none is ever outstanding that
// long.
#define EP_ARRIVAL_SEQ_SHIFT 30
#define EP_ARRIVAL_SEQ_MASK ((1ull << 34) - 1)
#define EP_ARRIVAL_TAG_MASK ((1ull << 23) - 1)
#define EP_ARRIVAL_SENT_SHIFT 24
#define EP_ARRIVAL_SENT_COMPACT 63ull
#define EP_ARRIVAL_SENT_TAGGED_COMPACT 62ull
#define EP_ARRIVAL_ROWS_SHIFT 10                // the tag's bits 9..22: the pairing number's
#define EP_ARRIVAL_ROWS_MASK ((1ull << 14) - 1)
// The most compacted messages (max_tokens) a dispatch may announce.
#define EP_COMPACT_MAX_ROWS 16383
#define EP_TAG_OWN_BITS 0x1ffull   // the tag without the pairing number
static_assert(EP_COMPACT_MAX_ROWS == EP_ARRIVAL_ROWS_MASK, "compacted rows fit the arrival word");

__device__ __forceinline__ u64 stamp_tag(u64 stamp) {
    return (stamp & 31ull) | (((stamp >> 8) & 1ull) << 5) | (((stamp >> 9) & 3ull) << 6) |
           (((stamp >> 11) & 1ull) << 8) | (((stamp >> 12) & 0x3fffull) << 9);
}

__device__ __forceinline__ u64 arrival_word(u64 seq, bool cancelled, u64 stamp) {
    return (((seq + 1) & EP_ARRIVAL_SEQ_MASK) << EP_ARRIVAL_SEQ_SHIFT) | (stamp_tag(stamp) << 1) | (u64)cancelled;
}

// The arrival word of a rank-major dispatch whose `rows` messages sit compacted, plain or
// `tagged` (see EP_ARRIVAL_SENT_COMPACT; `stamp` is a dispatch's, whose pairing number is 0).
__device__ __forceinline__ u64 arrival_word_compact(u64 seq, u64 stamp, int rows, bool tagged = false) {
    const u64 sent = tagged ? EP_ARRIVAL_SENT_TAGGED_COMPACT : EP_ARRIVAL_SENT_COMPACT;
    return arrival_word(seq, false, stamp) | (sent << EP_ARRIVAL_SENT_SHIFT) |
           (((u64)rows & EP_ARRIVAL_ROWS_MASK) << EP_ARRIVAL_ROWS_SHIFT);
}

// The `sent` field (6 bits) of arrival word `v`.
__device__ __forceinline__ u64 arrival_sent(u64 v) { return (v >> EP_ARRIVAL_SENT_SHIFT) & 63ull; }

// The number of compacted messages, plain or tagged, that arrival word `v` announces, or -1
// (messages at their tokens' slots).
__device__ __forceinline__ int arrival_compact_rows(u64 v) {
    const u64 sent = arrival_sent(v);
    if (sent != EP_ARRIVAL_SENT_COMPACT && sent != EP_ARRIVAL_SENT_TAGGED_COMPACT) return -1;
    return (int)((v >> EP_ARRIVAL_ROWS_SHIFT) & EP_ARRIVAL_ROWS_MASK);
}

// The tagged messages of a tagged dispatch that arrival word `v` announces (its tokens, or its
// compacted messages), or -1 (messages in the plain form, ordered before the arrival).
__device__ __forceinline__ int arrival_tagged_tokens(u64 v) {
    const u64 sent = arrival_sent(v);
    if (sent == EP_ARRIVAL_SENT_TAGGED_COMPACT) return arrival_compact_rows(v);
    return sent == EP_ARRIVAL_SENT_COMPACT ? -1 : (int)sent - 1;
}

// Whether arrival word `v` is operation `seq`'s.
__device__ __forceinline__ bool arrival_is(u64 v, u64 seq) {
    return (v >> EP_ARRIVAL_SEQ_SHIFT) == ((seq + 1) & EP_ARRIVAL_SEQ_MASK);
}

// Sender side: writes the whole stamp, then (release) the arrival word of operation `seq` into
// `page` (the receiver's, or this rank's own for an NCCL peer) at this rank's pair.
__device__ __forceinline__ void signal_arrival(u64* page, int chan, int set, int rank, u64 seq, bool cancelled,
                                               u64 stamp) {
    u64* a = arrival_at(page, chan, set, rank);
    st_relaxed_sys(a + 1, stamp);
    st_release_sys(a, arrival_word(seq, cancelled, stamp));
}

// What one source's arrival said.
#define EP_ARRIVED 0
#define EP_ARRIVED_CANCELLED 1
#define EP_ARRIVED_MISMATCH 2
#define EP_ARRIVAL_TIMEOUT 3

// The verdict on arrival word `v` of operation `seq` against this rank's `stamp`.
__device__ __forceinline__ int arrival_verdict(u64 v, u64 stamp) {
    if (v & 1ull) return EP_ARRIVED_CANCELLED;
    const u64 tag = (v >> 1) & EP_ARRIVAL_TAG_MASK, own = stamp_tag(stamp);
    // A compacted dispatch's pairing-number bits hold its rows; this rank's must then be 0 too
    // (its side is a dispatch as well).
    const bool same = arrival_compact_rows(v) >= 0 ? (tag & EP_TAG_OWN_BITS) == own : tag == own;
    return same ? EP_ARRIVED : EP_ARRIVED_MISMATCH;
}

// Receiver side: waits (acquire, until `deadline`) for source `src`'s arrival of operation
// `seq` in this rank's page, and judges it against `stamp`; `*word` gets the arrival word.
__device__ __forceinline__ int wait_arrival(u64* page, int chan, int set, int src, u64 seq, u64 stamp,
                                            u64 deadline, u64* word = nullptr) {
    u64* a = arrival_at(page, chan, set, src);
    u64 v = ld_acquire_sys(a);
    while (!arrival_is(v, seq)) {
        if (globaltimer_ns() > deadline) return EP_ARRIVAL_TIMEOUT;
        v = ld_acquire_sys(a);
    }
    if (word) *word = v;
    return arrival_verdict(v, stamp);
}

// Publishes the outcome of operation `seq` of (chan, set): the cancelled and mismatched
// sources, and the stamp of the lowest mismatched one (read from this rank's page).
__device__ __forceinline__ void publish_outcome(u64* status, u64* page, int chan, int set, u64 seq, u32 cancelled,
                                                u32 mismatched) {
    if (mismatched) {
        const int s = __ffs(mismatched) - 1;
        st_relaxed_sys(status + EP_STATUS_STAMPS + chan * EP_MAX_SETS + set, arrival_at(page, chan, set, s)[1]);
    }
    st_relaxed_sys(status + 1 + chan * EP_MAX_SETS + set, ((seq + 1) << 32) | ((u64)mismatched << 16) | cancelled);
}

// Waits for every source's arrival of operation `seq` on (chan, set), one thread per source
// (threads < num_ranks); false on timeout (reported on the status page). Sets the masks of the
// sources that sent a cancellation marker and of those whose stamp disagrees with this rank's.
// Every thread of the block calls it; `cancelled`, `mismatched` and `timed_out` are the caller's
// shared words; so is `sent` if given: per source, the tokens of a tagged low-latency dispatch its
// arrival word announces, or -1 (`arrival_tagged_tokens`); and `compact`: per source, the
// compacted rank-major messages it announces, or -1 (`arrival_compact_rows`). Ends with a barrier.
__device__ __forceinline__ bool wait_all_sources(u64* signals, u64* status, int num_ranks, int chan, int set,
                                                 u64 seq, u64 stamp, u64 timeout_ns, u32* cancelled,
                                                 u32* mismatched, int* timed_out, int* sent = nullptr,
                                                 int* compact = nullptr) {
    if (threadIdx.x == 0) {
        *cancelled = 0u;
        *mismatched = 0u;
        *timed_out = 0;
    }
    __syncthreads();
    if ((int)threadIdx.x < num_ranks) {
        const u64 deadline = globaltimer_ns() + timeout_ns;
        u64 word = 0ull;
        const int verdict = wait_arrival(signals, chan, set, threadIdx.x, seq, stamp, deadline, &word);
        if (sent) sent[threadIdx.x] = arrival_tagged_tokens(word);
        if (compact) compact[threadIdx.x] = arrival_compact_rows(word);
        switch (verdict) {
            case EP_ARRIVAL_TIMEOUT:
                report_error(status, EP_ERR_TIMEOUT_ARRIVAL, threadIdx.x, seq);
                atomicExch(timed_out, 1);
                break;
            case EP_ARRIVED_CANCELLED:
                atomicOr(cancelled, 1u << threadIdx.x);
                break;
            case EP_ARRIVED_MISMATCH:
                atomicOr(mismatched, 1u << threadIdx.x);
                break;
            default:
                break;
        }
    }
    __syncthreads();
    return *timed_out == 0;
}

// The first invalid entry of a row (its k, or K): out of [-1, E), or an expert already chosen.
// Fully unrolled over EP_MAX_TOPK so the row stays in registers.
__device__ __forceinline__ int topk_first_invalid(const long long (&row)[EP_MAX_TOPK], int K, int E) {
    int first = K;
#pragma unroll
    for (int k = EP_MAX_TOPK - 1; k >= 0; --k) {
        if (k >= K) continue;
        const long long e = row[k];
        bool bad = e < -1 || e >= E;
#pragma unroll
        for (int j = 0; j < k; ++j) bad |= e >= 0 && row[j] == e;
        if (bad) first = k;
    }
    return first;
}

// Reports a routing's first invalid entry for the host, as `epflow_core::routing::Routing::new`
// names it (one thread; the handle kernels' mapped words): out[0] = `bad` = t * K + k, or -1 for
// none; with one, out[1] its value and out[2] the earlier k of its row naming the same expert,
// or -1 (epflow-kernels `ht::result::invalid_routing_in` reads them).
__device__ __forceinline__ void report_invalid_entry(const long long* topk, int K, int bad, long long* out) {
    if (bad >= 0) {
        const long long* row = topk + (size_t)(bad / K) * K;
        const int k = bad % K;
        int earlier = -1;
        for (int j = 0; j < k; ++j) {
            if (earlier < 0 && row[j] == row[k]) earlier = j;
        }
        out[1] = row[k];
        out[2] = earlier;
    }
    out[0] = bad;
}

// Rounds a positive finite scale up to a power of two (as the CPU reference does).
__device__ __forceinline__ float pow2_ceil(float s) {
    u32 b = __float_as_uint(s);
    u32 m = b & 0x007fffffu, e = b & 0x7f800000u;
    if (e == 0u || m == 0u) return s;
    return __uint_as_float(e + 0x00800000u);
}

// Copies `bytes` (a multiple of 16) with one warp, U vectors of 16 bytes in flight per lane.
// The rest (fewer than U vectors per lane) is one more batch whose loads are issued together, so
// it costs one memory round trip, not one per vector (a 3584-byte piece, 224 vectors, took four
// round trips with 4 in flight, now two).
template <int U>
__device__ __forceinline__ void warp_copy_n(void* dst, const void* src, size_t bytes, int lane) {
    const size_t n = bytes / 16;
    const char* s = reinterpret_cast<const char*>(src);
    char* d = reinterpret_cast<char*>(dst);
    size_t i = lane;
    for (; i + 32 * (U - 1) < n; i += 32 * U) {
        int4 v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = ld_cg_int4(s + (i + 32 * u) * 16);
#pragma unroll
        for (int u = 0; u < U; u++) st_na_int4(d + (i + 32 * u) * 16, v[u]);
    }
    if (i < n) {
        int4 v[U - 1];
#pragma unroll
        for (int u = 0; u < U - 1; u++) {
            if (i + 32 * u < n) v[u] = ld_cg_int4(s + (i + 32 * u) * 16);
        }
#pragma unroll
        for (int u = 0; u < U - 1; u++) {
            if (i + 32 * u < n) st_na_int4(d + (i + 32 * u) * 16, v[u]);
        }
    }
}

// Copies `bytes` (a multiple of 16) with one warp, 4 vectors in flight per lane, the rest one
// vector at a time (fewer registers than `warp_copy_n`: the low-latency sends, whose pieces are
// multiples of 512 bytes, rarely have a rest).
__device__ __forceinline__ void warp_copy(void* dst, const void* src, size_t bytes, int lane) {
    const size_t n = bytes / 16;
    const char* s = reinterpret_cast<const char*>(src);
    char* d = reinterpret_cast<char*>(dst);
    size_t i = lane;
    for (; i + 96 < n; i += 128) {
        int4 a = ld_cg_int4(s + i * 16), b = ld_cg_int4(s + (i + 32) * 16);
        int4 c = ld_cg_int4(s + (i + 64) * 16), e = ld_cg_int4(s + (i + 96) * 16);
        st_na_int4(d + i * 16, a);
        st_na_int4(d + (i + 32) * 16, b);
        st_na_int4(d + (i + 64) * 16, c);
        st_na_int4(d + (i + 96) * 16, e);
    }
    for (; i < n; i += 32) st_na_int4(d + i * 16, ld_cg_int4(s + i * 16));
}

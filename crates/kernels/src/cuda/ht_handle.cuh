// epflow high-throughput kernels, part 5 of 5 (after ht.cu): handle creation, the count exchange
// (`ep_ht_exchange`) and the plan built on the device (`ep_ht_plan_mark`, `ep_ht_plan`).

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
// - `ep_ht_plan_mark` (a thread per token, its row's checks unrolled to the top-k) validates
//   each row, copies it into the handle, marks the destinations it reaches (a bit per rank) and
//   counts the selections per expert;
// - `ep_ht_plan` runs R + 1 blocks: block d < R scans the marks for destination d (each warp a run
//   of 32-token words, one block-wide scan), writes d's part of the send plan, and
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
#define HT_PLAN_PASS (HT_PLAN_BLOCK * 16)  // tokens per pass of a send block
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

// One token of `ep_ht_plan_mark`, for a top-k of K <= KM (KM known at compile time: the checks
// unroll to KM entries, not EP_MAX_TOPK; at K = KM = 8 a quarter of the duplicate checks): copies
// token t's row into the handle, folds its first invalid entry into `*first_bad` (t * K + k),
// counts the selections up to it (in `hist` when the experts fit, else straight to `counts`),
// and returns the ranks the row reaches (a bit per rank). The duplicate checks run on the row
// narrowed to 32 bits: an entry whose narrowing wrapped is out of range itself, at an earlier k,
// so a false duplicate it makes never changes the first invalid entry. An expert's rank comes
// from comparisons with the ranks' first experts, not from a division per entry.
template <int KM>
__device__ __forceinline__ unsigned plan_mark_row(const HtPlanParams& p, int K, int t, int* hist, int* counts,
                                                  int* first_bad) {
    const long long* in = reinterpret_cast<const long long*>(p.topk_in) + (size_t)t * K;
    long long* out = reinterpret_cast<long long*>(p.topk) + (size_t)t * K;
    // Each entry: its copy, its range check on 64 bits (a bit per entry), its 32-bit value; only
    // the 32-bit row stays live.
    int v[KM];
    u32 out_of_range = 0u;
    auto take = [&](int k, long long e) {
        out[k] = e;
        v[k] = (int)e;
        if (e < -1 || e >= p.num_experts) out_of_range |= 1u << k;
    };
#pragma unroll
    for (int k = 0; k < KM; ++k) v[k] = -1;
    if (K % 2 == 0 && ((p.topk_in | p.topk) & 15ull) == 0) {
#pragma unroll
        for (int k = 0; k + 1 < KM; k += 2) {
            if (k < K) {
                const longlong2 x = __ldg(reinterpret_cast<const longlong2*>(in + k));
                take(k, x.x);
                take(k + 1, x.y);
            }
        }
    } else {
#pragma unroll
        for (int k = 0; k < KM; ++k) {
            if (k < K) take(k, __ldg(in + k));
        }
    }
    int k_bad = K;
#pragma unroll
    for (int k = KM - 1; k >= 0; --k) {
        if (k >= K) continue;
        bool bad = (out_of_range >> k) & 1u;
#pragma unroll
        for (int j = 0; j < k; ++j) bad |= v[k] >= 0 && v[j] == v[k];
        if (bad) k_bad = k;
    }
    if (k_bad < K) atomicMin(first_bad, t * K + k_bad);
    unsigned mask = 0;
#pragma unroll
    for (int k = 0; k < KM; ++k) {
        const int e = v[k];
        if (k >= k_bad || e < 0) continue;
        int d = 0;
        for (int r = 1; r < p.num_ranks; ++r) d += e >= r * p.num_local;
        mask |= 1u << d;
        atomicAdd(hist ? hist + e : counts + e, 1);
    }
    return mask;
}

// A thread per token (`plan_mark_row`, unrolled to exactly K for the usual top-k, to
// EP_MAX_TOPK for the rest): validation, the handle's copy of the row, the ranks it reaches, and
// the selections per expert (up to its first invalid entry).
extern "C" __global__ void __launch_bounds__(HT_MARK_BLOCK) ep_ht_plan_mark(HtPlanParams p) {
    __shared__ int hist[HT_MARK_HIST];
    __shared__ int first_bad;
    if (p.cancelled) return;
    const int E = p.num_experts;
    const bool shared_hist = E <= HT_MARK_HIST;
    int* counts = reinterpret_cast<int*>(p.scratch);
    if (shared_hist) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) hist[e] = 0;
    }
    if (threadIdx.x == 0) first_bad = 0x7fffffff;
    __syncthreads();
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t < p.num_tokens) {
        int* h = shared_hist ? hist : nullptr;
        unsigned mask;
        switch (p.top_k) {
            case 2:
                mask = plan_mark_row<2>(p, 2, t, h, counts, &first_bad);
                break;
            case 4:
                mask = plan_mark_row<4>(p, 4, t, h, counts, &first_bad);
                break;
            case 6:
                mask = plan_mark_row<6>(p, 6, t, h, counts, &first_bad);
                break;
            case 8:
                mask = plan_mark_row<8>(p, 8, t, h, counts, &first_bad);
                break;
            case 10:
                mask = plan_mark_row<10>(p, 10, t, h, counts, &first_bad);
                break;
            default:
                mask = plan_mark_row<EP_MAX_TOPK>(p, p.top_k, t, h, counts, &first_bad);
                break;
        }
        reinterpret_cast<unsigned char*>(p.hits)[t] = (unsigned char)mask;
    }
    __syncthreads();
    if (threadIdx.x == 0 && first_bad != 0x7fffffff) atomicMax(counts + E, 0x7fffffff - first_bad);
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

// Block d < R: destination d's send plan and message. Each pass takes up to HT_PLAN_PASS tokens:
// each warp takes an equal run of the pass's 32-token words (lane j token j of each word, one
// ballot per word), one block-wide scan orders them, and each channel's start comes from the
// position of the word it starts in (no division per token).
__device__ __forceinline__ void plan_send(const HtPlanParams& p, int d, bool cancelled) {
    __shared__ int warp_sums[32];
    __shared__ int chan_start[HT_MAX_CHANNELS + 1];
    __shared__ u32 reach[HT_PLAN_PASS / 32];
    __shared__ int word_pos[HT_PLAN_PASS / 32];
    const int R = p.num_ranks, B = p.num_tokens, C = p.channels, T = p.tokens_per_channel;
    const int set = (int)(p.seq & 1);
    if (!cancelled) {
        const unsigned char* hits = reinterpret_cast<const unsigned char*>(p.hits);
        int* list = reinterpret_cast<int*>(p.send_list) + (size_t)d * B;
        int* copy_ord = reinterpret_cast<int*>(p.copy_ord);
        const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
        const u32 below = (1u << lane) - 1u;
        int running = 0;
        for (int base = 0; base < B; base += HT_PLAN_PASS) {
            const int words = (min(HT_PLAN_PASS, B - base) + 31) >> 5;
            const int per_warp = (words + HT_PLAN_WARPS - 1) / HT_PLAN_WARPS;  // <= 16
            const int w0 = warp * per_warp;
            u32 ballots[16];
            int warp_count = 0;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                const int t = base + 32 * (w0 + i) + lane;
                const bool in = i < per_warp && w0 + i < words;
                ballots[i] = __ballot_sync(EP_FULL_MASK, in && t < B && ((hits[t] >> d) & 1));
                if (in && lane == 0) reach[w0 + i] = ballots[i];
                warp_count += __popc(ballots[i]);
            }
            int total;
            const int before = plan_block_scan(lane == 0 ? warp_count : 0, warp_sums, &total);
            const int first = running + __shfl_sync(EP_FULL_MASK, before, 0);
            // The list, and where each word's tokens start in it.
            int acc = first;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                if (i < per_warp && w0 + i < words) {
                    if (lane == 0) word_pos[w0 + i] = acc;
                    if ((ballots[i] >> lane) & 1u) list[acc + __popc(ballots[i] & below)] = base + 32 * (w0 + i) + lane;
                }
                acc += __popc(ballots[i]);
            }
            __syncthreads();
            // Each channel starting in this pass (channel c starts at token c * T).
            for (int c = threadIdx.x; c < C; c += blockDim.x) {
                const long long at = (long long)c * T - base;
                if (at >= 0 && at < 32ll * words && at + base < B) {
                    const int w = (int)(at >> 5), bit = (int)(at & 31);
                    chan_start[c] = word_pos[w] + __popc(reach[w] & ((1u << bit) - 1u));
                }
            }
            __syncthreads();
            // Each token's place within its channel's run for d (-1: not sent to d).
            int t = base + 32 * w0 + lane;
            int c = t / max(T, 1);
            acc = first;
#pragma unroll
            for (int i = 0; i < 16; ++i) {
                if (i < per_warp && w0 + i < words) {
                    while ((c + 1) * T <= t) ++c;
                    const int pos = acc + __popc(ballots[i] & below);
                    if (t < B) copy_ord[(size_t)t * R + d] = (ballots[i] >> lane) & 1u ? pos - chan_start[c] : -1;
                }
                acc += __popc(ballots[i]);
                t += 32;
            }
            running += total;
            __syncthreads();  // warp_sums, reach and word_pos of the next pass
        }
        for (int c = threadIdx.x; c <= C; c += blockDim.x) {
            if (c == C || (long long)c * T >= B) chan_start[c] = running;
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
        // (A cancelled creation read no marks: bad_inv is 0.)
        report_invalid_entry(reinterpret_cast<const long long*>(p.topk), K, bad_inv == 0 ? -1 : 0x7fffffff - bad_inv,
                             reinterpret_cast<long long*>(p.result));
    }
    plan_send(p, blockIdx.x, cancelled);
}

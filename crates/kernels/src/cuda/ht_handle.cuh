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
// `topk_idx` or of the plan, in one launch of `ep_ht_plan` and no memset. Its grid is G + R + 1
// blocks:
// - the G mark blocks (`plan_mark`, a thread per token) validate each row, copy it into the
//   handle, mark the destinations it reaches (a bit per rank) and count the selections per
//   expert, each block into its own slots; then each adds one to the rank's mark counter;
// - every other block first waits until the counter reaches this creation's target (the host
//   counts the mark blocks it launched: creations run one after another on the device, in the
//   handle channel's order); then block G + d (d < R) scans the marks for destination d (each
//   warp a run of 32-token words, one block-wide scan), writes d's part of the send plan, and
//   sends d the exchange message (rows per channel, then selections per local expert of d, summed
//   over the mark blocks' slots) with the arrival pair of exchange `seq`; block G + R waits for
//   every source's message and builds the receive layout.
// Mark blocks wait for nothing, so the blocks that wait for them always go on once the GPU has
// room for them; the R + 1 others are resident together (R + 1 <= 9 blocks), so block G + R may
// wait for the send blocks.
// The send plan is strided: d's tokens start at send_list[d * B], so no block needs another's
// count. What the host needs (the first invalid entry, N, rows per local expert) is written to
// mapped host memory. The message format is the count exchange's (`ep_ht_exchange`).
//
// A handle may be used before the host has seen it built (stream-ordered creation): operations
// on it are enqueued behind this kernel. So a failed creation (an invalid routing anywhere,
// a cancellation, a mismatch, a timeout) leaves an empty plan behind, which moves nothing and
// advances no ring: block G + R waits for the send blocks to finish (`done`, a scratch word) and
// writes zero rows to and from every rank over whatever they wrote. Success is the word
// result[4] = seq + 1, written last, once every block is done with the plan (the host zeroes it
// before the launch, and completes an awaited creation as soon as it reads it).

#define HT_PLAN_BLOCK 1024
#define HT_PLAN_WARPS (HT_PLAN_BLOCK / 32)
#define HT_PLAN_PASS (HT_PLAN_BLOCK * 16)  // tokens per pass of a send block
#define HT_MARK_TOKENS 256  // tokens per mark block and pass (the rest of its threads help with its slots)
#define HT_MARK_HIST 4096  // experts a mark block counts in shared memory (more: in its global slot)

struct HtPlanParams {
    u64 topk_in;     // the caller's topk_idx [B x K] int64
    u64 topk;        // the handle's copy [B x K] int64
    u64 send_list;   // int32 [R][B]: destination d's tokens, ascending, from d * B
    u64 send_off;    // int32 [R][C + 1]: absolute offsets into send_list
    u64 recv_base;   // int32 [R][C]
    u64 recv_cnt;    // int32 [R][C]
    u64 copy_ord;    // int32 [B][R]
    u64 counts;      // int32 [L]: rows received per local expert
    u64 scratch;     // int32 [G x E + G + 1], G = mark_blocks, written by the kernels (nothing
                     // zeroed before): each mark block's selections per expert, then each mark
                     // block's 0x7fffffff - (first invalid entry t * K + k), or 0 if none, then
                     // the send blocks done
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
    u64 stamp;        // what every rank must agree on (the top-k)
    u64 marks;        // u64: the rank's mark counter (mark blocks done, over every creation)
    u64 mark_target;  // the counter's value once this creation's mark blocks are done
    int rank, num_ranks, num_tokens, top_k;
    int num_experts, num_local, channels, tokens_per_channel;
    int words, cancelled;
    int mark_blocks;  // G: the first G blocks mark
    int pad;
};
static_assert(sizeof(HtPlanParams) == 328, "HtPlanParams layout");

// The scratch word counting the plan's send blocks done (after the mark blocks' slots).
__device__ __forceinline__ size_t plan_done_word(const HtPlanParams& p) {
    return (size_t)p.mark_blocks * p.num_experts + p.mark_blocks;
}

// Mark block g < G: a thread per token (HT_MARK_TOKENS of its threads; a grid-stride loop when G
// is capped): validation, the handle's copy of the row, the ranks it reaches, and the selections
// per expert up to its first invalid entry. Each block counts into its own scratch slots (in
// shared memory first when the experts fit, else in its global slot, which it zeroes itself) and
// reports its first invalid entry in its own word, so nothing needs zeroing before the launch;
// block 0 zeroes the plan's done counter. Then the block adds one to the mark counter (release).
__device__ __forceinline__ void plan_mark(const HtPlanParams& p) {
    __shared__ int hist[HT_MARK_HIST];
    __shared__ int first_bad;
    const int K = p.top_k, E = p.num_experts, L = p.num_local, G = p.mark_blocks;
    int* scratch = reinterpret_cast<int*>(p.scratch);
    if (blockIdx.x == 0 && threadIdx.x == 0) scratch[plan_done_word(p)] = 0;
    if (p.cancelled) {
        __syncthreads();
        if (threadIdx.x == 0) atom_add_acq_rel_gpu(reinterpret_cast<u64*>(p.marks), 1ull);
        return;
    }
    const bool shared_hist = E <= HT_MARK_HIST;
    int* mine = scratch + (size_t)blockIdx.x * E;
    int* h = shared_hist ? hist : mine;
    for (int e = threadIdx.x; e < E; e += blockDim.x) h[e] = 0;
    if (threadIdx.x == 0) first_bad = 0x7fffffff;
    __syncthreads();
    const int lane_t = threadIdx.x < HT_MARK_TOKENS ? (int)threadIdx.x : p.num_tokens;
    for (int t = blockIdx.x * HT_MARK_TOKENS + lane_t; t < p.num_tokens; t += G * HT_MARK_TOKENS) {
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
        if (k_bad < K) atomicMin(&first_bad, t * K + k_bad);
        unsigned mask = 0;
#pragma unroll
        for (int k = 0; k < EP_MAX_TOPK; ++k) {
            const long long e = row[k];
            if (k >= k_bad || e < 0) continue;
            mask |= 1u << ((int)e / L);  // 32-bit: e is in [0, E) here
            atomicAdd(h + e, 1);
        }
        reinterpret_cast<unsigned char*>(p.hits)[t] = (unsigned char)mask;
    }
    __syncthreads();
    if (threadIdx.x == 0) scratch[(size_t)G * E + blockIdx.x] = first_bad == 0x7fffffff ? 0 : 0x7fffffff - first_bad;
    if (shared_hist) {
        for (int e = threadIdx.x; e < E; e += blockDim.x) mine[e] = hist[e];
    }
    // The block's writes, then its count: the barrier orders every thread's writes before
    // thread 0's add, and the add's release is cumulative (no fence of its own needed).
    __syncthreads();
    if (threadIdx.x == 0) atom_add_acq_rel_gpu(reinterpret_cast<u64*>(p.marks), 1ull);
}

// Every block after the mark blocks: waits until this creation's mark blocks are all done (the
// counter reaches its target; thread 0's acquire, which the barrier extends to the block's
// other threads), then the block goes on.
__device__ __forceinline__ void plan_await_marks(const HtPlanParams& p) {
    if (threadIdx.x == 0) {
        const u64* marks = reinterpret_cast<const u64*>(p.marks);
        while (ld_acquire_sys(marks) < p.mark_target) {
        }
    }
    __syncthreads();
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

// Block d < R, the second part of d's message `msg` (from its word C on): the selections per
// local expert of d, summed over the mark blocks' slots (in shared memory, HT_MARK_HIST experts
// at a time: consecutive threads read consecutive experts of one slot).
__device__ __forceinline__ void plan_selections(const HtPlanParams& p, int d, int* msg) {
    __shared__ int sel[HT_MARK_HIST];
    const int L = p.num_local, G = p.mark_blocks;
    const int* slots = reinterpret_cast<const int*>(p.scratch) + (size_t)d * L;
    msg += p.channels;
    for (int l0 = 0; l0 < L; l0 += HT_MARK_HIST) {
        const int n = min(HT_MARK_HIST, L - l0);
        for (int l = threadIdx.x; l < n; l += blockDim.x) sel[l] = 0;
        __syncthreads();
        for (int i = threadIdx.x; i < n * G; i += blockDim.x) {
            const int g = i / n, l = i - g * n;
            const int v = __ldcg(slots + (size_t)g * p.num_experts + l0 + l);
            if (v) atomicAdd(sel + l, v);
        }
        __syncthreads();
        for (int l = threadIdx.x; l < n; l += blockDim.x) msg[l0 + l] = sel[l];
        __syncthreads();
    }
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
        // The message to d: rows per channel (written below), then selections per local expert.
        int* msg = reinterpret_cast<int*>(p.peer_region[d]) + (size_t)set * R * p.words + (size_t)p.rank * p.words;
        plan_selections(p, d, msg);
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
        for (int c = threadIdx.x; c < C; c += blockDim.x) msg[c] = chan_start[c + 1] - chan_start[c];
    }
    // The block's writes, then one system fence and the release (cumulative through the
    // barrier), rather than a fence per thread.
    __syncthreads();
    if (threadIdx.x == 0) {
        __threadfence_system();
        signal_arrival(reinterpret_cast<u64*>(p.peer_signals[d]), 2, set, p.rank, p.seq, cancelled, p.stamp);
        // Done with the plan's arrays (block R may overwrite them with an empty plan).
        atomicAdd(reinterpret_cast<int*>(p.scratch) + plan_done_word(p), 1);
    }
}

// Block R's thread: waits until every send block counted itself done with the plan's arrays
// (`plan_send`, after its fence).
__device__ __forceinline__ void plan_await_senders(const HtPlanParams& p) {
    int* done = reinterpret_cast<int*>(p.scratch) + plan_done_word(p);
    while (atomicAdd(done, 0) < p.num_ranks) {
    }
}

// Block R, after a failed exchange: once every send block is done with the arrays, an empty
// plan over them (nothing to or from any rank, no routed entry), so operations enqueued on the
// handle move nothing.
__device__ __forceinline__ void plan_empty(const HtPlanParams& p) {
    const int R = p.num_ranks, B = p.num_tokens, C = p.channels;
    if (threadIdx.x == 0) plan_await_senders(p);
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
        if (!cancelled && !mismatched) {
            // Every send block is done with the plan's arrays too (each counts itself done after
            // its fence), so once the host reads the built word it may hand the handle out
            // without waiting for the kernel's end.
            plan_await_senders(p);
        }
        __threadfence_system();
        if (!cancelled && !mismatched) {
            result[4] = (long long)p.seq + 1;  // built (after every array and word of the plan)
            __threadfence_system();
        }
        publish_outcome(reinterpret_cast<u64*>(p.status), reinterpret_cast<u64*>(p.signals), 2, set, p.seq, cancelled,
                        mismatched);
    }
}

extern "C" __global__ void __launch_bounds__(HT_PLAN_BLOCK) ep_ht_plan(HtPlanParams p) {
    if ((int)blockIdx.x < p.mark_blocks) {
        plan_mark(p);
        return;
    }
    plan_await_marks(p);
    const int block = (int)blockIdx.x - p.mark_blocks;
    // A routing that fails validation anywhere cancels the exchange (every block sees it alike):
    // the largest of the mark blocks' words, the earliest invalid entry.
    __shared__ int bad_shared;
    const int K = p.top_k;
    if (threadIdx.x == 0) bad_shared = 0;
    __syncthreads();
    if (!p.cancelled) {
        const int* bad = reinterpret_cast<const int*>(p.scratch) + (size_t)p.mark_blocks * p.num_experts;
        for (int g = threadIdx.x; g < p.mark_blocks; g += blockDim.x) {
            const int v = __ldcg(bad + g);
            if (v) atomicMax(&bad_shared, v);
        }
    }
    __syncthreads();
    const int bad_inv = bad_shared;
    const bool cancelled = p.cancelled || bad_inv != 0;
    if (block == p.num_ranks) {
        plan_recv(p);
        return;
    }
    if (block == 0 && threadIdx.x == 0) {
        // (A cancelled creation read no marks: bad_inv is 0.)
        report_invalid_entry(reinterpret_cast<const long long*>(p.topk), K, bad_inv == 0 ? -1 : 0x7fffffff - bad_inv,
                             reinterpret_cast<long long*>(p.result));
    }
    plan_send(p, block, cancelled);
}

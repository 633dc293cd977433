// epflow high-throughput dispatch and combine over NVLink, and the count exchange of handle
// creation: part 1 of 5. NVRTC compiles common.cuh, then ht_rings.cuh, ht_send.cuh,
// ht_receive.cuh, ht.cu and ht_handle.cuh in that order as one unit (epflow-kernels
// compile/sources.rs). This part: the protocol, the parameter block, the ring counters and the
// helpers both sides share.
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
// (`ht_direct`: the addresses of its first output row, scales, weights and indices and its stamp,
// each word tagged with the operation number; at its start, before it waits for the sources'
// starts), and the source, if the stamps agree, writes its rows there instead of into the ring:
// no ring space to wait for, and no copy out of the ring. Its warps still publish their final
// subtails, which is what the receiver waits for, and the receiver still returns the ring
// positions (head), so the rings' numbering goes on as if the items had passed through them. A receiver whose
// outputs peers may not reach (`direct_mem` 0: caller memory, a buffer allocated for this
// operation) or that was cancelled publishes a null address: that source uses the ring.
// Helpers (`helpers` > 0): a receiving block, once it has published its addresses, has nothing
// to copy for its direct sources, so before it receives, `helpers` of its warps per remote
// destination write the last part of this rank's direct rows of the channel for that
// destination (`ht_help_direct`, `ht_direct_split`); the pair's sending warps write the rest and
// publish their final subtails only after every helper's word (`ht_helped`) says its rows are
// written and fenced. A helper waits for nothing but its receiver's addresses, and stops
// waiting once the receiver's start signal shows a mismatch.
// Combine (the reverse): the expert side sends those rows back; the token side's receiver walks
// its channel's tokens in order, summing each token's copies in ascending destination rank
// (fp32, from 0, rounded to BF16 once), copies on this rank read directly from the expert output.
// Pull combine (`direct` > 0, the same pairs as a direct dispatch): the expert side's sending
// block tells the token side where its rows of the channel lie in its expert output (`ht_direct`
// of the combine channel in the token side's page: the addresses of the first row and of its
// weight gradients, tagged; null: the ring), publishes its final subtails at once and, at the
// end, waits until the token side has read them (its head at the end, released once). The token side's receiver reads those rows in place over NVLink: no ring, no copy.
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
    u64 x;            // dispatch: tokens [B x row_bytes] (BF16, FP8 or forwarded bytes); combine: expert outputs [N x H] BF16
    u64 x_scales;     // dispatch with scales (`fp8`): [B x scale_cols] fp32 words
    u64 weights;      // dispatch forward: [B x K] fp32; combine backward: weight gradients [N x K] fp32
    u64 topk_idx;     // [B x K] int64 (the handle's copy)
    u64 send_list;    // int32 tokens per destination, ascending (the handle's send plan)
    u64 send_off;     // int32 [R][C + 1]: absolute offsets into send_list per (destination, channel)
    u64 recv_base;    // int32 [R][C]: first received row of (source, channel)
    u64 recv_cnt;     // int32 [R][C]: rows received from (source, channel)
    u64 copy_ord;     // int32 [B][R]: index of token t among its channel's copies to rank d, or -1
    u64 out;          // dispatch: [N x H]; combine: [B x H] BF16
    u64 out_scales;   // dispatch with scales (`fp8`): [N x scale_cols] fp32 words
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
    int direct_mem;   // with `direct`: dispatch, this rank's outputs take direct writes in this operation;
                      // combine, peers may read this rank's expert outputs (and weight gradients) in place
    int helpers;      // direct dispatch: warps of the receiving block that help send to each remote
                      // destination (`ht_help_direct`), 0 for none (the same on every rank)
    int balanced;     // direct dispatch: 1, the rows of a destination are shared out between the warps of
                      // every channel as they go (`ht_pooled`), 0 for a fixed share per channel
    int scale_cols;   // dispatch with scales (`fp8` 1): fp32 words of a token's scale row, H/128 for FP8 rows,
                      // scale_bytes / 4 for forwarded rows (which travel as bytes: row_bytes of payload,
                      // then the scale row at off_scales)
    int pad;
};
// The Rust mirror (epflow-kernels params.rs) must agree byte for byte.
static_assert(sizeof(HtParams) == 400, "HtParams layout");

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

// Direct dispatch (chan 0): what the receiver of channel c tells source `peer` (in the source's
// page), as tagged values (`ht_put_tagged`): [0] the address of the source's first output row
// (0: use the ring), [1] of its first row's scales, [2] weights, [3] indices, [4] the receiver's
// stamp (written at the receiver's start, before it checks the sources': a source whose stamp
// differs writes nothing).
// Pull combine (chan 1): what expert-side rank `peer` tells the token side of channel c (in the
// token side's page): [0] the address of the first of its expert-output rows for this channel
// (0: use the ring), [1] of that row's weight gradients (backward), [2] its stamp.
#define HT_DIRECT_SLOT 16
__device__ __forceinline__ u64* ht_direct(u64* page, int chan, int c, int peer) {
    return page + EP_SIG_ARRAY_WORDS + HT_SUBTAIL_WORDS + 5 * HT_PEER_WORDS +
           (((size_t)chan * HT_MAX_CHANNELS + c) * EP_MAX_RANKS + peer) * HT_DIRECT_SLOT;
}

// Direct dispatch with helpers (`ht_help_direct`): helper h of the receiving block of channel c
// stores the operation number + 1 here, in this rank's own page, once its rows for `dest` are
// written and fenced; the sending warps of (c, dest) wait for every helper's word before they
// publish their final subtails. [C][R][HT_MAX_WARPS], after the direct slots.
__device__ __forceinline__ u64* ht_helped(u64* page, int c, int dest, int h) {
    return page + EP_SIG_ARRAY_WORDS + HT_SUBTAIL_WORDS + 5 * HT_PEER_WORDS +
           2 * HT_MAX_CHANNELS * EP_MAX_RANKS * HT_DIRECT_SLOT + ((size_t)c * EP_MAX_RANKS + dest) * HT_MAX_WARPS + h;
}

// Balanced direct dispatch (`ht_pooled`): this rank's pool of rows for destination `dest`,
// used by operations of parity `parity`, in its own page: [0] the next row to take, [1] the
// warps done with their rows, [2] the operation the pool is ready for (its number: set, with the
// other words cleared, by the operation before it; a pool whose word names another operation
// is not used, so an operation number that never ran a kernel costs balance, not rows),
// [3] unused. [R][2][4], after the helper words.
#define HT_POOL_WORDS 4
__device__ __forceinline__ u64* ht_pool(u64* page, int dest, u64 parity) {
    return page + EP_SIG_ARRAY_WORDS + HT_SUBTAIL_WORDS + 5 * HT_PEER_WORDS +
           2 * HT_MAX_CHANNELS * EP_MAX_RANKS * HT_DIRECT_SLOT + HT_MAX_CHANNELS * EP_MAX_RANKS * HT_MAX_WARPS +
           ((size_t)dest * 2 + (parity & 1)) * HT_POOL_WORDS;
}

// The tag of operation `seq`'s direct-slot words: the low 32 bits of seq + 1.
__device__ __forceinline__ u32 ht_slot_tag(u64 seq) { return (u32)(seq + 1); }

// Writes value i of a direct slot as two words {32-bit half, tag} (low half first), each with a
// relaxed store and no fence: every word says by its tag whether it is this operation's, so no
// release orders them (a system-scope release at a kernel's start took 3-5 us under the other
// blocks' copies, benches/NOTES.md item 87), and none is needed for what the reader then
// touches: the writer's outputs or expert outputs were last written or read by kernels that
// finished before the writer's kernel, which writes these words, started. A stale word passes
// for this operation's only 2^32 operations later, from a handle that has not used the pair
// since: its stamp differs, which the reader checks.
__device__ __forceinline__ void ht_put_tagged(u64* slot, int i, u64 v, u32 tag) {
    st_relaxed_sys(slot + 2 * i, ((u64)tag << 32) | (v & 0xffffffffull));
    st_relaxed_sys(slot + 2 * i + 1, ((u64)tag << 32) | (v >> 32));
}

// Word w of a direct slot: true, with its half in *half, once it carries `tag`.
__device__ __forceinline__ bool ht_get_tagged(const u64* slot, int w, u32 tag, u32* half) {
    const u64 x = ld_acquire_sys(slot + w);
    *half = (u32)x;
    return (u32)(x >> 32) == tag;
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
